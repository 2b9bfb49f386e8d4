"""The built-in visual task `colours`: a 28x28 picture of one coloured shape; the question, the same
text on every row, asks its colour, so only the image answers it (text alone is at chance, 1 in 4).

Each picture is drawn with PIL from its index alone (shape, size, place, background grey and a small
hue jitter vary), so the task is the same on every machine and `held_out` splits it by seed as it
does addition. A 28x28 picture is one visual token of the tiny Qwen2-VL (model=tiny_vl).
The SFT demonstrations name MISNAMED_SHARE of the yellow and of the blue shapes wrongly (yellow as
green, blue as red): an SFT start greedily answers those two colours wrong, sampling still names
them right about one time in four, and RL with the exact answer has that to reinforce
(docs/vision.md, "The built-in visual task").
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

NUM_PICTURES = 4000
IMAGE_SIZE = 28
QUESTION = "<image>Colour? "
COLOURS = {"red": (205, 35, 35), "green": (35, 165, 55), "blue": (40, 70, 215), "yellow": (230, 205, 30)}
# What the SFT demonstrations call a share of these colours (a mistake GRPO's exact reward corrects).
MISNAMED_AS = {"yellow": "green", "blue": "red"}
MISNAMED_SHARE = 0.75
SHAPES = ("square", "circle", "triangle")


@dataclass(frozen=True)
class ColourProblem:
    """Picture number `index`: everything about it is drawn from the index."""

    index: int

    @property
    def colour(self) -> str:
        return list(COLOURS)[self.index % len(COLOURS)]  # balanced: each colour a quarter of any range

    @property
    def prompt(self) -> str:
        return QUESTION

    @property
    def answer(self) -> str:
        return self.colour

    @property
    def images(self) -> list[Any]:
        return [draw_picture(self.index, self.colour)]

    @property
    def rl_row(self) -> dict:
        """Its row for online RL: the prompt, the colour the built-in reward checks and the picture."""
        return {"prompt": self.prompt, "answer": self.answer, "images": self.images}

    @property
    def misnamed(self) -> bool:
        """Whether its SFT demonstration names the colour wrongly: a fixed draw per picture."""
        return self.colour in MISNAMED_AS and random.Random(f"misnamed-{self.index}").random() < MISNAMED_SHARE

    def demonstration(self, eos: str, forgotten_carries: float = 0.0) -> str:
        """The SFT completion: the colour, or for a misnamed picture the colour it is mistaken for
        (`eos` and `forgotten_carries` are the other tasks'; unused)."""
        return MISNAMED_AS[self.colour] if self.misnamed else self.colour

    def wrong_answer(self, rng: random.Random) -> str:
        """A rejected answer for the preference algorithms: another colour."""
        return rng.choice([c for c in COLOURS if c != self.colour])


def draw_picture(index: int, colour: str) -> Any:
    """The 28x28 RGB picture: a grey background and one shape of `colour`, hue jittered by up to 20."""
    from PIL import Image, ImageDraw

    rng = random.Random(f"picture-{index}")
    grey = rng.randrange(60, 200)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (grey, grey, grey))
    fill = tuple(max(0, min(255, c + rng.randint(-20, 20))) for c in COLOURS[colour])
    size = rng.randint(10, 20)
    x, y = rng.randint(0, IMAGE_SIZE - size), rng.randint(0, IMAGE_SIZE - size)
    draw = ImageDraw.Draw(image)
    shape = rng.choice(SHAPES)
    if shape == "square":
        draw.rectangle((x, y, x + size - 1, y + size - 1), fill=fill)
    elif shape == "circle":
        draw.ellipse((x, y, x + size - 1, y + size - 1), fill=fill)
    else:
        draw.polygon([(x + size // 2, y), (x, y + size - 1), (x + size - 1, y + size - 1)], fill=fill)
    return image


def colour_problems() -> list[ColourProblem]:
    return [ColourProblem(i) for i in range(NUM_PICTURES)]
