"""The trainer's vision tower sees each distinct image of a call once (a GRPO group's completions
and a DPO pair's sides carry the same prompt images); the features placed, and the tower's
gradients, are those of one tower call per image, and the M-RoPE positions are computed once per
layout of images. `rollout=hf` likewise processes each repeated image object once."""

from __future__ import annotations

import torch
from PIL import Image

from rltrain.models.vision import distinct_images, grid_model_inputs, grid_positions
from rltrain.runtime.torchvision_compat import ensure_torchvision


def test_distinct_images_keeps_first_appearances_and_compares_in_full():
    a_PC = torch.arange(8.0).reshape(4, 2)
    swapped_PC = a_PC.clone()
    swapped_PC[1] += 100  # first, middle (2) and last patches as a_PC's: the same bucket, another image
    wide_PC = torch.arange(16.0).reshape(8, 2)
    pixels = torch.cat([a_PC, a_PC, swapped_PC, wide_PC, a_PC])
    grid = torch.tensor([[1, 2, 2], [1, 2, 2], [1, 2, 2], [1, 2, 4], [1, 2, 2]])
    kept_pixels, kept_grid, source = distinct_images(pixels, grid)
    assert source == [0, 0, 1, 2, 0]
    assert torch.equal(kept_pixels, torch.cat([a_PC, swapped_PC, wide_PC]))
    assert kept_grid.tolist() == [[1, 2, 2], [1, 2, 2], [1, 2, 4]]
    two_PC = torch.cat([a_PC, swapped_PC])
    assert distinct_images(two_PC, grid[:2])[0] is two_PC  # nothing repeated: the call's own tensor


def test_repeated_images_give_the_features_and_tower_gradients_of_one_call_per_image(tiny_vl_dir):
    ensure_torchvision()
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir)
    processor = AutoProcessor.from_pretrained(tiny_vl_dir)
    images = [Image.new("RGB", (56, 56), c) for c in ((200, 0, 0), (0, 0, 200), (200, 0, 0), (200, 0, 0))]
    text = "<|vision_start|><|image_pad|><|vision_end|>Which? "
    batch = processor(text=[text] * 4, images=images, return_tensors="pt")
    marks_BT = (batch["input_ids"] == model.config.image_token_id).to(torch.int32)
    inputs = {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"], "mm_token_type_ids": marks_BT}
    inner = model.model
    got = grid_model_inputs(inner, batch["input_ids"], inputs)["inputs_embeds"]
    got_grads = torch.autograd.grad(got.square().sum(), list(inner.visual.parameters()))

    features = torch.cat(list(inner.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output))
    embeds = inner.get_input_embeddings()(batch["input_ids"])
    want = embeds.masked_scatter(marks_BT.bool()[..., None].expand_as(embeds), features)
    want_grads = torch.autograd.grad(want.square().sum(), list(inner.visual.parameters()))
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


def test_rollout_hf_processes_each_repeated_image_object_once(tiny_vl_dir):
    ensure_torchvision()
    from rltrain.rollout.hf_images import ImageInputs

    inputs = ImageInputs(tiny_vl_dir, image_token_id=0)
    red, blue, wide = Image.new("RGB", (56, 56), (200, 0, 0)), Image.new("RGB", (56, 56), (0, 0, 200)), Image.new("RGB", (84, 56))
    rows = [red, blue, red, wide, red, blue]
    calls = []
    pixels = inputs.pixels
    inputs.pixels = lambda images: calls.append(len(images)) or pixels(images)  # type: ignore[method-assign]
    expanded, _ = inputs.expand([[1, 0, 2], [0, 5, 0], [0]], [[red], [blue, red], [wide]])  # one placeholder per image
    assert [len(row) for row in expanded] == [6, 9, 6]  # 56x56: 4 visual tokens, 84x56: 6
    got, want = inputs.repeated_pixels(rows), pixels(rows)
    assert calls == [3]  # the three objects once, for expand and repeated_pixels both
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_positions_computed_once_per_layout_are_the_models_own(tiny_vl_dir):
    ensure_torchvision()
    from transformers import AutoModelForImageTextToText

    inner = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir).model
    width = 16
    marks_BT = torch.zeros(7, width, dtype=torch.int32)
    layouts = [  # (row, [(start, tokens)], grids) -- tokens = h * w / 4 (2x2 merge)
        (0, [(2, 4)], [[1, 4, 4]]), (1, [(2, 4)], [[1, 4, 4]]),  # a group: one layout
        (2, [(1, 1), (4, 6)], [[1, 2, 2], [1, 4, 6]]),  # two images
        (4, [(2, 4)], [[1, 2, 8]]),  # the same marks as rows 0-1, another grid
        (5, [(12, 4)], [[1, 4, 4]]),  # an image in the last columns
        (6, [(2, 4)], [[1, 4, 4]]),  # row 0's layout again, after others
    ]  # row 3: no image
    grids = []
    for row, runs, grid in layouts:
        for start, tokens in runs:
            marks_BT[row, start : start + tokens] = 1
        grids += grid
    grid_I3 = torch.tensor(grids)
    want_3BT = inner.get_rope_index(torch.zeros(7, width, dtype=torch.long), marks_BT, image_grid_thw=grid_I3)[0]
    calls = []
    original = inner.get_rope_index
    inner.get_rope_index = lambda ids, marks, **kw: calls.append(len(ids)) or original(ids, marks, **kw)
    assert torch.equal(grid_positions(inner, marks_BT, grid_I3), want_3BT)
    assert calls == [4]  # rows 0 (1, 6), 2, 4 and 5: one call over the four distinct layouts
