"""Row columns across the workers' JSON pipe (rltrain.data.column_wire): PIL images and bytes, alone
or nested, come back equal, each image's mode kept; a step's shared image is encoded and decoded once."""

from __future__ import annotations

import json

from PIL import Image

from rltrain.data.column_wire import from_wire, to_wire


def test_images_and_bytes_come_back_through_json():
    rgb, grey, rgba = Image.new("RGB", (3, 2), (1, 2, 3)), Image.new("L", (2, 2), 7), Image.new("RGBA", (1, 1), (9, 8, 7, 6))
    value = {"images": [[rgb, grey]], "image": [rgba], "raw": [b"\x00\xff", bytearray(b"ab")], "answer": ["x"],
             "nested": [{"img": rgb, "n": 1}]}
    back = from_wire(json.loads(json.dumps(to_wire(value))))
    (first, second), (third,) = back["images"][0], back["image"]
    for got, sent in ((first, rgb), (second, grey), (third, rgba)):
        assert isinstance(got, Image.Image) and got.mode == sent.mode and got.size == sent.size
        assert got.tobytes() == sent.tobytes()
    assert back["raw"] == [b"\x00\xff", b"ab"] and back["answer"] == ["x"] and back["nested"][0]["n"] == 1
    assert back["nested"][0]["img"] is first  # one image on the wire, one object in the worker


def test_a_shared_image_is_encoded_once():
    image = Image.new("RGB", (2, 2), (5, 5, 5))
    wired = to_wire({"images": [[image]] * 8})
    assert all(w[0] is wired["images"][0][0] for w in wired["images"])
    assert to_wire({"plain": [1, "a", None, 2.5]}) == {"plain": [1, "a", None, 2.5]}
