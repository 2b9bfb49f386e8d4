"""Run `python -m rltrain ...` as a user would, with a bounded time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A smaller tiny model, for runs whose subject is not the model (launching, failures).
SMALL_MODEL = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=128",
]

# model=tiny: RL tests start from the plain tiny model, not from algo=grpo's default SFT start
# (model=tiny_sft, built once per spec: tests/e2e/test_tiny_sft.py covers it).
QUICK = [
    "model=tiny",
    "logger.wandb.mode=disabled",
    "trainer.eval_every=0",
    "trainer.save_every=0",
    "trainer.progress=lines",
]


def rltrain(*args: str, run_dir: Path | None = None, timeout: float = 300, env: dict | None = None, check: bool = True):
    cmd = [sys.executable, "-m", "rltrain", *args]
    if run_dir is not None:
        cmd.append(f"hydra.run.dir={run_dir}")
    full_env = dict(os.environ, **(env or {}))
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}")
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "loss" in r]


def kill_when(args: list[str], run_dir: Path, ready: Path, sig: int, timeout: float = 240) -> None:
    """Start `python -m rltrain *args` in its own session, wait until `ready` exists, then send
    `sig` to its whole process group (every rank) and wait for it to end."""
    import time

    cmd = [sys.executable, "-m", "rltrain", *args, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, f"{ready} did not appear within {timeout}s"
        time.sleep(0.05)
    os.killpg(proc.pid, sig)
    proc.wait(timeout=60)


def comparable(rows: list[dict]) -> list[dict]:
    """Metric rows without the fields that measure time or memory (they differ run to run), any
    throughput (`tokens_per_s`, `rollout/tokens_per_s`) included."""
    return [
        {k: v for k, v in r.items() if not k.startswith(("time/", "mem/")) and not k.endswith("tokens_per_s")} for r in rows
    ]
