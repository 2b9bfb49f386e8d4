"""`python -m rltrain --help` (and `-h`): one screen of rltrain's own, in place of Hydra's generic page.

Hydra prints `hydra.help.template` (conf/config.yaml), which is `${rltrain_help:}`: this resolver,
called on the composed config, so the page shows the options each group has in conf/ (a new option
file appears by itself), the one this command chose, and the current values of the keys set most.
Hydra's own flags (`--cfg job`, `--hydra-help`, `-m`) are Hydra's. docs/configuration.md has every key.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rltrain.config.schema import CONF_DIR

RESOLVER = "rltrain_help"
RECIPES_GROUP = "experiment"  # added with a `+`: `+experiment=grpo_gsm8k`

# (key, what it is for): the keys a user sets most, shown with this command's value.
COMMON_KEYS = [
    ("model.path", "a Hugging Face model directory or Hub id; null: a tiny model"),
    ("data.path", "a .jsonl or .parquet file, saved dataset or Hub id; null: a task"),
    ("trainer.max_steps", "optimizer steps"),
    ("trainer.nproc", "local ranks (or start it under torchrun)"),
    ("trainer.global_batch_size", "SFT, DPO: examples per step"),
    ("algo.prompts_per_step", "GRPO, PPO: prompts per step, each sampled algo.group_size times"),
    ("optim.lr", "peak learning rate"),
    ("model.lora.rank", "> 0: train LoRA adapters on a frozen base"),
    ("trainer.resume", "auto: go on from the run directory's last checkpoint; never"),
    ("logger.wandb.mode", "auto, online, offline or disabled"),
]
RUN_DIR_KEY = ("hydra.run.dir=DIR", "the run directory: metrics.jsonl, checkpoints, final/")
_ABSENT = object()

EXAMPLES = [
    ("python -m rltrain", "GRPO on a built-in task, no model or data needed"),
    ("python -m rltrain algo=sft trainer.nproc=2", "SFT on two local ranks"),
    ("python -m rltrain algo=dpo backend=megatron", "DPO on megatron-core"),
    ("python -m rltrain model.path=DIR data.path=FILE", "your model and data"),
    ("python -m rltrain +experiment=NAME", "a recipe above, e.g. grpo_code or grpo_vision"),
    ("python -m rltrain reward_model=judge", "an LLM judge scores: reward_model.url or .path"),
    ("python -m rltrain -m optim.lr=1e-3,3e-3", "a sweep: one job per value"),
    ("python -m rltrain algo=dpo --cfg job", "print the composed config (every key); no run"),
]


def group_options() -> dict[str, list[str]]:
    """Each config group of conf/ and its options (the YAML files in its folder), Hydra's own
    `hydra/` groups left out."""
    return {
        folder.name: sorted(p.stem for p in folder.glob("*.yaml"))
        for folder in sorted(Path(CONF_DIR).iterdir())
        if folder.is_dir() and folder.name != "hydra"
    }


def command_help(cfg: DictConfig) -> str:
    """The help page for the composed config `cfg` (the root, with `hydra.runtime.choices`)."""
    chosen = OmegaConf.select(cfg, "hydra.runtime.choices", default={}) or {}
    lines = [
        "rltrain: post-train a causal language model (SFT, DPO, KTO, ORPO, SimPO, reward models, GRPO,",
        "PPO, on-policy distillation) on an FSDP2 or megatron-core backend, on CPU or GPU.",
        "",
        "Usage: python -m rltrain [GROUP=OPTION ...] [KEY=VALUE ...] [--cfg job] [-m] [--help]",
        "",
        "Groups (the option this command chooses in [brackets]):",
    ]
    groups = group_options()
    recipes = groups.pop(RECIPES_GROUP, [])
    for group, options in groups.items():
        marked = [f"[{o}]" if chosen.get(group) == o else o for o in options]
        lines.append(f"  {group:<14}{'  '.join(marked)}")
    if recipes:  # +experiment=NAME, as many names to a line as fit
        wrapped = textwrap.wrap("  ".join(recipes), 82, break_on_hyphens=False)
        lines += [f"  {f'+{RECIPES_GROUP}' if i == 0 else '':<14}{line}" for i, line in enumerate(wrapped)]
    lines += ["", "Keys set most (current value):"]
    for key, meaning in COMMON_KEYS:
        value = OmegaConf.select(cfg, key, default=_ABSENT)
        shown = "..." if value is _ABSENT else "null" if value is None else value  # absent: another algo's key
        lines.append(f"  {f'{key}={shown}':<32}{meaning}")
    lines.append(f"  {RUN_DIR_KEY[0]:<32}{RUN_DIR_KEY[1]}")
    lines += ["", "Examples:"]
    lines += [f"  {command:<48}{what}" for command, what in EXAMPLES]
    lines += [
        "",
        "Every key and its meaning: docs/configuration.md (python -m rltrain --cfg job prints them);",
        "the rest of the docs: README.md and docs/. Hydra's own flags: python -m rltrain --hydra-help.",
    ]
    return "\n".join(lines).replace("$", "$$")  # Hydra reads the page as a string.Template


def register_help() -> None:
    """Make `${rltrain_help:}` resolvable (once per process; composing needs it registered)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, lambda *, _root_: command_help(_root_))
