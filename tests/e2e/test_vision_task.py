"""The built-in visual task (docs/vision.md, "The built-in visual task"): the image carries the answer.

The cheap test runs a short real SFT of the tiny vision-language model on `data.task=colours` and
reads its greedy answers: on the held-out pictures as rltrain's evaluation measured, and, given each
row the next row's picture (the question text is the same on every row), following the picture
and not the row; given a blank picture, at chance. The slow tests are the claims: a longer SFT follows
the picture in 80% of its replies, and `+experiment=grpo_vision` raises held-out accuracy by at least
0.15 over its SFT start on seeds 0 and 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from cli import read_metrics, rltrain

from rltrain.data import tasks
from rltrain.data.colour_task import MISNAMED_AS, ColourProblem

pytestmark = pytest.mark.e2e

QUIET = ["logger.wandb.mode=disabled", "trainer.save_every=0", "trainer.progress=lines"]
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>"


def greedy_answers(model_dir, problems: list[ColourProblem], images: list) -> list[str]:
    """The model's greedy reply to each problem's question beside the given picture (transformers'
    own generate, outside rltrain)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    replies = []
    for problem, image in zip(problems, images, strict=True):
        text = problem.prompt.replace("<image>", IMAGE_PROMPT)
        batch = processor(text=[text], images=[image], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=8, do_sample=False)
        replies.append(processor.tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return replies


def accuracy(replies: list[str], answers: list[str]) -> float:
    return sum(r == a for r, a in zip(replies, answers, strict=True)) / len(answers)


def named(problem: ColourProblem) -> set[str]:
    """What a model taught by the demonstrations may call the problem's colour: the colour, or the
    one its demonstrations misname it as (yellow: green, blue: red)."""
    return {problem.answer, MISNAMED_AS.get(problem.answer, problem.answer)}


@dataclass
class PictureReading:
    """What an SFT'd model's greedy replies show about the pictures (see the tests below)."""

    sft_accuracy: float  # rltrain's held-out evaluation
    blind_best: float  # the most one reply for every row could score: the largest colour's share
    follows_picture: float  # share of rows, each given the next row's picture, answered to fit that picture
    follows_row: float  # among those rows whose own colour is not on their picture, share naming it anyway
    blank_replies: int  # distinct replies over the rows given a blank picture


def sft_on_colours(run_dir, steps: int, seed: int) -> PictureReading:
    rltrain("algo=sft", "model=tiny_vl", "data.task=colours", "data.num_eval=100", f"trainer.max_steps={steps}",
            f"trainer.seed={seed}", "optim.lr=3e-3", "optim.warmup_steps=10", "trainer.eval_every=0", "trainer.log_every=20",
            *QUIET, run_dir=run_dir, timeout=900)
    _, held = tasks.colours_split(seed, 100)
    answers = [p.answer for p in held]
    on_pictures = greedy_answers(run_dir / "final", held, [p.images[0] for p in held])
    sft_accuracy = [r for r in read_metrics(run_dir) if "eval/accuracy" in r][-1]["eval/accuracy"]
    assert abs(accuracy(on_pictures, answers) - sft_accuracy) < 1e-9  # rltrain's evaluation reads the pictures the same
    # Each row given the next row's picture (the question text is the same on every row). A model blind
    # to the picture gives every row one reply, which fits at most half the pictures (a colour and the
    # one misnamed as it: a quarter each).
    swapped = held[1:] + held[:1]
    on_swapped = greedy_answers(run_dir / "final", held, [p.images[0] for p in swapped])
    follows_picture = sum(r in named(s) for r, s in zip(on_swapped, swapped, strict=True))
    unlike = [i for i, (p, s) in enumerate(zip(held, swapped, strict=True)) if not named(p) & named(s)]
    assert len(unlike) >= len(held) // 4
    follows_row = sum(on_swapped[i] in named(held[i]) for i in unlike)
    # Given a blank picture (the grey background alone), nothing in a row tells the rows apart.
    from PIL import Image

    blank = Image.new("RGB", held[0].images[0].size, (128, 128, 128))
    on_blank = greedy_answers(run_dir / "final", held, [blank] * len(held))
    blank_accuracy = accuracy(on_blank, answers)
    blind_best = max(answers.count(c) for c in set(answers)) / len(answers)
    assert blank_accuracy <= blind_best  # one colour's share (chance)
    return PictureReading(sft_accuracy, blind_best, follows_picture / len(held), follows_row / len(unlike),
                          len(set(on_blank)))


@pytest.mark.slow  # images reach the model and change its scores: test_cli_vision*.py's fp32-parity runs, in make test
def test_a_short_sft_on_colours_reads_the_picture(tiny_cache, tmp_path):
    """80 steps land in different places on different CPUs (docs/testing.md, "What learns in `make
    test`": accuracy 0.41-0.53, 77-94% fitting the picture, 8-25% naming the row's colour), so this
    asserts that the replies come from the picture, with those margins; the slow test below, the claim."""
    reading = sft_on_colours(tmp_path / "run", steps=80, seed=0)
    assert reading.sft_accuracy >= reading.blind_best + 0.05, reading
    assert reading.follows_picture >= 0.6 and reading.follows_row <= 0.4, reading
    assert reading.blank_replies == 1, reading


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_a_longer_sft_on_colours_follows_the_picture(tiny_cache, tmp_path, seed):
    """160 steps: red and green named, yellow and blue mostly misnamed as demonstrated (held-out
    accuracy at least 0.4), at least 80% of the replies fitting another row's picture, and at most a
    quarter naming a row's colour its picture does not show (measured over seeds 0-2 and two instruction sets:
    0.51-0.56, 95-98%, 4-6%)."""
    reading = sft_on_colours(tmp_path / "run", steps=160, seed=seed)
    assert reading.sft_accuracy >= 0.4 and reading.follows_picture >= 0.8 and reading.follows_row <= 0.25, reading
    assert reading.blank_replies == 1, reading


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_vision_raises_heldout_accuracy_over_its_sft_start(tiny_cache, tmp_path, seed):
    run_dir = tmp_path / "run"
    rltrain("+experiment=grpo_vision", f"trainer.seed={seed}", *QUIET, run_dir=run_dir, timeout=3600)
    evals = [r for r in read_metrics(run_dir) if "eval/accuracy" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 40, evals
    start, end = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    assert end - start >= 0.15, evals
