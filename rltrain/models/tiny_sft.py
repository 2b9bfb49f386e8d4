"""`model=tiny_sft`: the tiny model after a short SFT on the built-in task, built once and cached.

RL from the randomly initialised tiny model has no right answers to reinforce. The SFT start sees
every training sum that does not carry and `model.sft_carry_problems` that do, with the carry out of
the units forgotten in `model.sft_forgotten_carries` of those (the tens digit one short): it learns
to add and, greedily, forgets that carry, while sampling still carries about one time in six. That
plateau does not depend on where a steep learning curve was cut, so the start, and RL's gain from
it, hold across seeds and CPUs. The SFT is an ordinary `algo=sft` run in a clean child process, on
the training split only. docs/internals/models.md has the details.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rltrain.config.plain_values import tasks_override
from rltrain.config.schema import DataConfig, ModelConfig, TrainerConfig
from rltrain.models.tiny import build_tiny_model_dir, publish_directory
from rltrain.models.tiny_moe import build_tiny_moe_model_dir
from rltrain.models.tiny_vl import build_tiny_vl_model_dir
from rltrain.runtime.errors import UserError
from rltrain.runtime.parent_death import DIE_WITH_PARENT_ENV

# Variables a rank inherits from its launcher (torch.distributed, torchrun/elastic): the child must
# build a world of its own, not join (or wait for) the parent's.
# (A single-rank run sets MASTER_ADDR/MASTER_PORT for itself too: rltrain/runtime/distributed.py.)
LAUNCHER_ENV_PREFIX = "TORCHELASTIC_"
LAUNCHER_ENV_NAMES = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
}
# The base model of each tiny architecture's SFT start: the `model=` group its SFT run loads it as,
# and its builder.
BASE_GROUP = {"qwen2_vl": "model=tiny_vl", "qwen3_moe": "model=tiny_moe"}
BASE_BUILDER = {"qwen2_vl": build_tiny_vl_model_dir, "qwen3_moe": build_tiny_moe_model_dir}
# What the SFT writes into the cache entry beside the weights: its metrics, to show its accuracy.
SFT_METRICS = "sft_metrics.jsonl"
LOG_TAIL_CHARS = 4000


def check_sft_data(data_cfg: DataConfig) -> None:
    """The SFT start is built from the built-in task; a user dataset has no such split."""
    if data_cfg.path is not None:
        raise UserError(
            f"model=tiny_sft (model.sft_steps > 0) fine-tunes the built-in tiny model on the built-in "
            f"'{data_cfg.task}' task, but data.path={data_cfg.path!r} names your own dataset. Use model=tiny "
            "(or model.sft_steps=0) to train the tiny model on it, or point model.path at your model."
        )


def sft_key(model_cfg: ModelConfig, data_cfg: DataConfig, base_dir: Path) -> str:
    """Hash of everything the SFT'd weights depend on beyond the base model (named by `base_dir`)."""
    recipe = {
        "base": base_dir.name,  # the tiny spec and seed, already hashed by build_tiny_model_dir
        "sft_steps": model_cfg.sft_steps,
        "sft_lr": float(model_cfg.sft_lr),
        "task": data_cfg.task,
        "num_eval": data_cfg.num_eval,
        "num_train": data_cfg.num_train,
        "carry_problems": model_cfg.sft_carry_problems,
        "format": 1,
    }
    if model_cfg.sft_forgotten_carries:  # absent otherwise, as eval_seed below
        recipe["forgotten_carries"] = float(model_cfg.sft_forgotten_carries)
    if data_cfg.eval_seed is not None:  # absent otherwise: the keys of existing caches stay valid
        recipe["eval_seed"] = data_cfg.eval_seed
    if data_cfg.tasks:  # data=reasoning_gym's generators (absent otherwise, as above)
        recipe["tasks"] = tasks_override(list(data_cfg.tasks))
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def sft_command(
    model_cfg: ModelConfig, data_cfg: DataConfig, trainer_cfg: TrainerConfig, base_dir: Path, run_dir: Path
) -> list[str]:
    """The `python -m rltrain algo=sft ...` run that fine-tunes `base_dir` (one rank, no W&B, the
    run's seed and thread count)."""
    return [
        sys.executable, "-m", "rltrain",
        "algo=sft",
        BASE_GROUP.get(model_cfg.arch, "model=tiny"),
        f"model.path={base_dir}",
        f"trainer.seed={trainer_cfg.seed}",
        f"trainer.num_threads={trainer_cfg.num_threads}",
        f"trainer.max_steps={model_cfg.sft_steps}",
        f"optim.lr={model_cfg.sft_lr}",
        "trainer.nproc=1",
        "trainer.eval_every=0",  # evaluated once, at the end: the accuracy the RL run starts from
        "trainer.save_every=0",
        "trainer.resume=never",
        "trainer.progress=lines",
        "logger.wandb.mode=disabled",
        f"data.task={data_cfg.task}",
        f"data.num_eval={data_cfg.num_eval}",
        f"data.num_train={data_cfg.num_train}",
        f"data.eval_seed={'null' if data_cfg.eval_seed is None else data_cfg.eval_seed}",
        f"data.max_carry_problems={'null' if model_cfg.sft_carry_problems is None else model_cfg.sft_carry_problems}",
        f"data.forgotten_carries={model_cfg.sft_forgotten_carries}",
        f"hydra.run.dir={run_dir}",
        *([tasks_override(list(data_cfg.tasks))] if data_cfg.tasks else []),
    ]


def child_env() -> dict[str, str]:
    """This process's environment without the launcher's torch.distributed variables, asking the
    child to die with this process (a killed run leaves no SFT running behind it)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV_NAMES and not k.startswith(LAUNCHER_ENV_PREFIX)}
    env[DIE_WITH_PARENT_ENV] = str(os.getpid())
    return env


def final_accuracy(metrics_path: Path) -> float | None:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    return evals[-1] if evals else None


def build_sft_model_dir(model_cfg: ModelConfig, data_cfg: DataConfig, trainer_cfg: TrainerConfig) -> Path:
    """Build (once) and return the SFT'd tiny model's Hugging Face directory, cached beside the tiny model."""
    check_sft_data(data_cfg)
    if model_cfg.sft_steps < 1:
        raise UserError(f"model.sft_steps={model_cfg.sft_steps} must be at least 1 for an SFT start (0: model=tiny).")
    # model=tiny_vl_sft, tiny_moe_sft: the tiny vision-language model's, the tiny MoE's SFT start
    base_dir = BASE_BUILDER.get(model_cfg.arch, build_tiny_model_dir)(model_cfg, trainer_cfg.seed)
    carry = "" if model_cfg.sft_carry_problems is None else f", {model_cfg.sft_carry_problems} of its sums that carry"
    if model_cfg.sft_forgotten_carries:
        carry += f" (the carry out of the units forgotten in {model_cfg.sft_forgotten_carries:.0%} of those)"
    target = base_dir.parent / f"{base_dir.name}-sft-{sft_key(model_cfg, data_cfg, base_dir)}"
    if (target / "config.json").exists():
        return target
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=base_dir.parent))
    try:
        run_dir = tmp / "run"
        log_path = tmp / "sft.log"
        print(
            f"rltrain: building the SFT'd tiny model once: {model_cfg.sft_steps} SFT steps (lr {model_cfg.sft_lr:g}) "
            f"on the '{data_cfg.task}' training split{carry}, cached in {target} (progress: {log_path}) ...",
            flush=True,
        )
        with log_path.open("w") as log:
            proc = subprocess.run(
                sft_command(model_cfg, data_cfg, trainer_cfg, base_dir, run_dir),
                env=child_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        if proc.returncode != 0:
            tail = log_path.read_text()[-LOG_TAIL_CHARS:]
            raise RuntimeError(f"building the SFT'd tiny model failed (exit {proc.returncode}); its output ends:\n{tail}")
        final = run_dir / "final"
        (run_dir / "metrics.jsonl").rename(final / SFT_METRICS)
        publish_directory(final, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    accuracy = final_accuracy(target / SFT_METRICS)
    print(
        f"rltrain: SFT'd tiny model ready in {time.monotonic() - started:.0f} s "
        f"(held-out accuracy {accuracy}); later runs reuse it",
        flush=True,
    )
    return target
