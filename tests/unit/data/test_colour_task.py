"""The built-in visual task (`data.task=colours`, rltrain/data/colour_task.py): every row asks the same
question, so the text alone is at chance, and each answer is read off the picture's pixels; the
pictures are the same on every call; the SFT demonstrations misname a fixed share of yellow and blue;
and the built-in data path gives each row its picture through the model's processor."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from rltrain.config.schema import DataConfig
from rltrain.data import colour_task, tasks
from rltrain.data.colour_task import COLOURS, MISNAMED_AS, ColourProblem


def colour_in_pixels(image) -> str:
    """The named colour nearest the mean of the picture's coloured (not grey) pixels."""
    pixels = np.asarray(image).reshape(-1, 3).astype(float)
    coloured = pixels[pixels.max(axis=1) != pixels.min(axis=1)]
    assert len(coloured), "a picture without its shape"
    mean = coloured.mean(axis=0)
    return min(COLOURS, key=lambda name: sum((a - b) ** 2 for a, b in zip(COLOURS[name], mean, strict=True)))


def test_each_answer_is_in_the_picture_and_the_text_is_the_same_on_every_row():
    problems = colour_task.colour_problems()
    assert len(problems) == colour_task.NUM_PICTURES
    assert {p.prompt for p in problems} == {colour_task.QUESTION}  # the text tells no row from another
    for p in problems[:400]:
        (image,) = p.images
        assert image.size == (28, 28) and colour_in_pixels(image) == p.answer


def test_pictures_are_deterministic_and_vary():
    a, b = ColourProblem(17).images[0], ColourProblem(17).images[0]
    assert a.tobytes() == b.tobytes()
    assert len({ColourProblem(i).images[0].tobytes() for i in range(0, 200, 4)}) == 50  # same colour, 50 pictures


@pytest.mark.parametrize("seed", [0, 1])
def test_the_split_is_disjoint_balanced_and_follows_the_seed(seed):
    train, held = tasks.colours_split(seed, 200)
    assert not {p.index for p in train} & {p.index for p in held}
    counts = collections.Counter(p.answer for p in held)
    assert set(counts) == set(COLOURS) and max(counts.values()) <= 0.35 * len(held)  # text-only chance: about 1/4
    assert [p.index for p in held] != [p.index for p in tasks.colours_split(seed + 1, 200)[1]]


def test_demonstrations_misname_a_share_of_yellow_and_blue_only():
    problems = colour_task.colour_problems()
    for colour in COLOURS:
        shown = [p.demonstration("</s>") for p in problems if p.colour == colour]
        wrong = sum(d != colour for d in shown) / len(shown)
        if colour in MISNAMED_AS:
            assert abs(wrong - colour_task.MISNAMED_SHARE) < 0.05 and set(shown) == {colour, MISNAMED_AS[colour]}
        else:
            assert wrong == 0


def test_builtin_rows_carry_the_picture_and_the_true_answer(tiny_vl_dir):
    from rltrain.data.preference_data import build_preference_data
    from rltrain.data.prompt_data import build_prompt_data
    from rltrain.data.sft_data import build_sft_data
    from rltrain.data.unpaired_data import build_unpaired_data
    from rltrain.models.tokenizer import load_tokenizer
    from rltrain.models.vision import load_processor

    processor = load_processor(tiny_vl_dir, load_tokenizer(tiny_vl_dir))
    data_cfg = DataConfig(task="colours", num_eval=8, num_train=16)
    train, evals, dropped = build_prompt_data(processor.tokenizer, data_cfg, 0, processor=processor)
    assert len(train) == 16 and len(evals) == 8 and dropped == 0
    for row in evals:
        assert row.columns["answer"] == colour_in_pixels(row.images[0]) and row.vision is not None
        # Reward functions get every column, the picture as a PIL image (docs/rewards-and-roles.md).
        assert [image.tobytes() for image in row.columns["images"]] == [image.tobytes() for image in row.images]
    sft = build_sft_data(processor.tokenizer, data_cfg, 0, processor)
    assert [item.reference for item in sft.eval] == [r.columns["answer"] for r in evals]
    assert all(pair.vision is not None for pair in sft.train)
    prefs = build_preference_data(processor.tokenizer, data_cfg, 0, processor)  # DPO's pairs: another colour rejected
    assert len(prefs.train) == 16 and prefs.eval_answers == [r.columns["answer"] for r in evals]
    assert all(pair.vision is not None and pair.chosen != pair.rejected for pair in prefs.train + prefs.eval)
    unpaired = build_unpaired_data(processor.tokenizer, data_cfg, 0, processor)  # KTO: each completion with its picture
    assert len(unpaired.train) == 32 and all(e.vision is not None for e in unpaired.train)
    assert all(pair.vision is not None for pair in unpaired.eval)
