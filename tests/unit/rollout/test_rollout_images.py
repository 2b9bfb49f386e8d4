"""Images in rollout prompts (rltrain/rollout/images.py): placeholders, vLLM's prompt, and the PNG
data URLs images cross process and HTTP boundaries as."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from rltrain.rollout import images as im
from rltrain.rollout.server import images as si

PAD = 9  # an image token id


def picture(seed: int, size=(28, 56), mode="RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, channels), dtype=np.uint8)
    return Image.fromarray(pixels, mode)


def test_collapse_keeps_one_placeholder_per_image():
    ids = [1, 8, PAD, PAD, PAD, 7, 8, PAD, PAD, 7, 3]
    assert im.collapse_placeholders(ids, PAD) == [1, 8, PAD, 7, 8, PAD, 7, 3]
    assert im.placeholder_runs(ids, PAD) == 2
    assert im.placeholder_runs([1, 2], PAD) == 0


def test_vllm_prompt_of_text_and_image_rows():
    assert im.vllm_prompt(0, [1, 2], None, PAD) == {"prompt_token_ids": [1, 2]}
    assert im.vllm_prompt(0, [1, 2], [], None) == {"prompt_token_ids": [1, 2]}
    a, b = picture(0), picture(1)
    got = im.vllm_prompt(3, [1, PAD, PAD, 5, PAD, 6], [a, b], PAD)
    assert got["prompt_token_ids"] == [1, PAD, 5, PAD, 6]
    assert got["multi_modal_data"]["image"] == [a, b]


def test_vllm_prompt_refuses_bad_rows():
    with pytest.raises(ValueError, match="prompt 4 has 1 image placeholder.* but 2 image"):
        im.vllm_prompt(4, [1, PAD, PAD, 2], [picture(0), picture(1)], PAD)
    with pytest.raises(ValueError, match="prompt 2 has images but the rollout engine's model is text-only"):
        im.vllm_prompt(2, [1, 2], [picture(0)], None)
    with pytest.raises(ValueError, match="2 image lists for 3 prompts"):
        im.check_batch([[1], [2], [3]], [[], []])


def test_expanded_prompt():
    expanded = [1, PAD, PAD, PAD, 2]
    assert im.expanded_prompt(0, expanded, expanded, PAD) is None  # the row's own ids
    assert im.expanded_prompt(0, [1, PAD, 2], expanded, PAD) == expanded  # one placeholder given: vLLM's
    with pytest.raises(ValueError, match=r"prompt 5: its 1 image\(s\) take 2 visual tokens .* but 3"):
        im.expanded_prompt(5, [1, PAD, PAD, 2], expanded, PAD)


def test_data_url_round_trip_is_lossless():
    image = picture(3, size=(31, 17))
    url = im.to_data_url(image)
    assert url.startswith("data:image/png;base64,")
    back = im.from_data_url(url)
    assert back.size == image.size and np.array_equal(np.asarray(back), np.asarray(image))
    # Other modes arrive as the RGB every image processor converts them to.
    rgba = picture(4, mode="RGBA")
    assert np.array_equal(np.asarray(im.from_data_url(im.to_data_url(rgba))), np.asarray(rgba.convert("RGB")))
    rows = [[image, rgba], []]
    decoded = im.images_from_json(im.images_to_json(rows))
    assert decoded is not None and [len(r) for r in decoded] == [2, 0]
    assert im.images_to_json(None) is None and im.images_from_json(None) is None


def test_data_url_refuses_anything_but_png():
    buf = io.BytesIO()
    picture(0).save(buf, format="JPEG")
    jpeg = base64.b64encode(buf.getvalue()).decode()
    with pytest.raises(ValueError, match="does not hold a PNG"):
        im.from_data_url("data:image/png;base64," + jpeg)
    with pytest.raises(ValueError, match=r"must be a data URL \(data:image/png;base64,...\)"):
        im.from_data_url("data:image/jpeg;base64," + jpeg)  # JPEG only where asked for
    assert im.from_data_url("data:image/jpeg;base64," + jpeg, ("PNG", "JPEG")).size == (56, 28)
    with pytest.raises(ValueError, match="must be a data URL"):
        im.from_data_url("file:///etc/passwd")
    with pytest.raises(ValueError, match="does not hold a PNG"):
        im.from_data_url("data:image/png;base64,not base64!")
    with pytest.raises(ValueError, match="list of lists"):
        im.images_from_json(["data:image/png;base64,"])


def test_server_request_fields_and_answer(tmp_path):
    a, b = picture(0), picture(1)
    fields = si.generate_fields(2, [1, PAD, PAD, 4, PAD, 5], [a, b], PAD)
    assert fields["token_ids"] == [1, PAD, 4, PAD, 5] and fields["return_token_ids"] is True
    assert [p["type"] for p in fields["content_parts"]] == ["image_url", "image_url"]
    assert np.array_equal(np.asarray(im.from_data_url(fields["content_parts"][1]["url"])), np.asarray(b))
    assert si.generate_fields(0, [1, 2], [], PAD) == {"token_ids": [1, 2]}
    assert si.answered_prompt(0, [1, PAD, 2], {"prompt_token_ids": [1, PAD, PAD, 2]}, PAD) == [1, PAD, PAD, 2]
    assert si.answered_prompt(0, [1, 2], {"choices": []}, PAD) is None
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_vl", "image_token_id": 151655}')
    assert si.model_image_token(tmp_path) == 151655
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    assert si.model_image_token(tmp_path) is None


def test_chat_image_parts_round_trip():
    a = picture(5)
    buf = io.BytesIO()
    a.save(buf, format="JPEG")
    jpeg_part = {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()}}
    messages = [
        {"role": "system", "content": "look"},
        {"role": "user", "content": [{"type": "text", "text": "which?"}, si.chat_image_part(a), jpeg_part]},
    ]
    got = si.message_images(messages)
    assert len(got) == 2 and np.array_equal(np.asarray(got[0]), np.asarray(a)) and got[1].size == a.size
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: an image must be a data URL"):
        si.message_images(bad)
