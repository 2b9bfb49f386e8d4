"""The image dataset the vision-language end-to-end tests share (tests/e2e/test_cli_vision.py and
test_cli_vision_rl.py): colour squares of 28 and 56 pixels as files, beside SFT, preference,
unpaired (KTO) and RL prompt jsonl files that name them, and a reward module for RL runs. Written
once per test session (the `image_data` fixture), so the shared runs that read it are one run."""

from __future__ import annotations

import json
from pathlib import Path

COLOURS = {"red": (220, 20, 20), "blue": (20, 20, 220), "green": (20, 200, 20)}
# A reward that differs between samples, so the policy's weights move every step and each step's
# parity is measured against new weights.
SPREAD_REWARD = "def spread(prompts, completions, **_):\n    return [len(set(c)) / 8 for c in completions]\n"
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
        (root / "spread_reward.py").write_text(SPREAD_REWARD)
        (root / DONE).write_text("")
    return root


def grpo_vision_run(root: Path) -> list[str]:
    """GRPO on the prompts with images, on vLLM (2 steps; its env: `reward_env`): the run
    tests/e2e/test_cli_vision.py checks parity on, and time sharing is compared with."""
    return ["algo=grpo", "model=tiny_vl", f"data.path={root / 'prompts.jsonl'}", "reward.fns=[spread_reward:spread]",
            "algo.prompts_per_step=4", "algo.group_size=2", "trainer.max_steps=2", "trainer.eval_every=0", "data.num_eval=2",
            "logger.wandb.mode=disabled", "optim.lr=1e-2", "trainer.progress=lines"]


def reward_env(root: Path) -> dict[str, str]:
    """The environment that makes the reward module importable by the run's processes."""
    return {"PYTHONPATH": str(root)}
