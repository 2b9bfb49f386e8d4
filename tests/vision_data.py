"""The image dataset the vision-language end-to-end tests share (tests/e2e/test_cli_vision.py and
test_cli_vision_rl.py): colour squares of 28 and 56 pixels as files, beside SFT, preference,
unpaired (KTO) and RL prompt jsonl files that name them, the RL prompts again as parquet in the
`datasets` Image layout (`{"bytes": ..., "path": None}` in a column `img`, with each row's first
colour), and reward modules for RL runs. Written once per test session (the `image_data`
fixture), so the shared runs that read it are one run."""

from __future__ import annotations

import json
from pathlib import Path

COLOURS = {"red": (220, 20, 20), "blue": (20, 20, 220), "green": (20, 200, 20)}
# A reward that differs between samples, so the policy's weights move every step and each step's
# parity is measured against new weights.
SPREAD_REWARD = "def spread(prompts, completions, **_):\n    return [len(set(c)) / 8 for c in completions]\n"
# A reward that reads every column: the image columns (`img`, and its copy `images` when
# data.columns.images=img) must be RGB PIL images of the row's colour, else it raises (the run stops).
SEES_IMAGES_REWARD = """\
def sees_the_images(prompts, completions, **columns):
    from PIL import Image
    for img, images, colour in zip(columns["img"], columns["images"], columns["colour"]):
        for column in (img, images):
            if not (isinstance(column, list) and all(isinstance(i, Image.Image) and i.mode == "RGB" for i in column)):
                raise TypeError(f"an image column arrived as {column!r:.80}")
            if column[0].getpixel((0, 0)) != tuple(colour):
                raise ValueError(f"another row's image: {column[0].getpixel((0, 0))} for {colour}")
    return [1.0] * len(completions)
"""
DONE = "DONE"


def write_image_data(root: Path) -> Path:
    """Write the files into `root` (once: a lock, then a marker) and return it."""
    from filelock import FileLock
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / "write.lock")):
        if (root / DONE).exists():
            return root
        (root / "imgs").mkdir(exist_ok=True)
        sft, pref, unpaired = [], [], []
        names = list(COLOURS)
        for i in range(8):
            name, wrong = names[i % 3], names[(i + 1) % 3]
            Image.new("RGB", (28, 28) if i % 2 else (56, 56), COLOURS[name]).save(root / "imgs" / f"{i}.png")
            images = [f"imgs/{i}.png"]
            sft.append({"images": images, "prompt": "<image>Colour? ", "completion": name})
            pref.append({"images": images, "prompt": "<image>Colour? ", "chosen": name, "rejected": wrong})
            unpaired += [{"images": images, "prompt": "<image>Colour? ", "completion": c, "label": c == name} for c in (name, wrong)]
        # RL prompts: one image, or two of different sizes
        prompts = [{"images": [f"imgs/{i}.png"] + ([f"imgs/{i + 1}.png"] if i % 2 else []),
                    "prompt": "<image>" * (1 + i % 2) + "Colour? "} for i in range(7)]
        for name, rows in (("sft", sft), ("pref", pref), ("unpaired", unpaired), ("prompts", prompts)):
            (root / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        write_image_layout_prompts(root, prompts)
        (root / "spread_reward.py").write_text(SPREAD_REWARD)
        (root / "sees_images_reward.py").write_text(SEES_IMAGES_REWARD)
        (root / DONE).write_text("")
    return root


def write_image_layout_prompts(root: Path, prompts: list[dict]) -> None:
    """`prompts_image_layout.parquet`: the RL prompts with their images' bytes in the datasets Image
    layout (column `img`, a list per row) and each row's first colour (`colour`)."""
    import datasets
    from PIL import Image

    def colour(path: str) -> list[int]:
        return list(Image.open(root / path).convert("RGB").getpixel((0, 0)))

    columns = {
        "img": [[{"bytes": (root / p).read_bytes(), "path": None} for p in r["images"]] for r in prompts],
        "prompt": [r["prompt"] for r in prompts],
        "colour": [colour(r["images"][0]) for r in prompts],
    }
    features = datasets.Features({"img": [datasets.Image()], "prompt": datasets.Value("string"),
                                  "colour": [datasets.Value("int64")]})
    datasets.Dataset.from_dict(columns, features=features).to_parquet(str(root / "prompts_image_layout.parquet"))


def grpo_vision_run(root: Path) -> list[str]:
    """GRPO on the prompts with images, on vLLM (2 steps; its env: `reward_env`): the run
    tests/e2e/test_cli_vision.py checks parity on, and time sharing is compared with."""
    return ["algo=grpo", "model=tiny_vl", f"data.path={root / 'prompts.jsonl'}", "reward.fns=[spread_reward:spread]",
            "algo.prompts_per_step=4", "algo.group_size=2", "trainer.max_steps=2", "trainer.eval_every=0", "data.num_eval=2",
            "logger.wandb.mode=disabled", "optim.lr=1e-2", "trainer.progress=lines"]


def reward_env(root: Path) -> dict[str, str]:
    """The environment that makes the reward module importable by the run's processes."""
    return {"PYTHONPATH": str(root)}
