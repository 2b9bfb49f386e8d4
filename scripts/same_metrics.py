"""Do two source trees of rltrain produce the same numbers? A check for refactors.

    python scripts/same_metrics.py run TREE OUT          # every configuration below, TREE's code
    python scripts/same_metrics.py compare OUT_A OUT_B   # row-for-row equality of metrics.jsonl
    python scripts/same_metrics.py both TREE_A TREE_B OUT

Each configuration is a short run of one algorithm (SFT, DPO, GRPO, PPO) on FSDP (2 ranks) and on
Megatron TP=2, plus GRPO with time sharing, each with an evaluation. `compare` requires every
metric row to be *bitwise* equal except for the fields that measure time or memory (`time/*`,
`mem/*`, throughputs), which differ run to run on one tree too. A tree is run as
`PYTHONPATH=TREE python -m rltrain` from TREE, so its own `conf/` is composed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

COMMON = [
    "logger.wandb.mode=disabled", "trainer.progress=lines", "trainer.save_every=0", "trainer.nproc=2",
    "trainer.eval_every=2", "trainer.log_every=1",
]
RL = ["model=tiny", "algo.prompts_per_step=8", "algo.group_size=4", "trainer.max_steps=3", "trainer.micro_batch_size=16"]
OFFLINE = ["trainer.max_steps=4", "trainer.global_batch_size=8", "trainer.micro_batch_size=4"]
MEGATRON = ["backend=megatron", "backend.tp=2"]

CONFIGS: dict[str, list[str]] = {
    "sft_fsdp": ["algo=sft", *OFFLINE],
    "dpo_fsdp": ["algo=dpo", *OFFLINE],
    "grpo_fsdp": ["algo=grpo", *RL],
    "grpo_fsdp_timeshare": ["algo=grpo", *RL, "placement.time_sharing=true"],
    "ppo_fsdp": ["algo=ppo", *RL],
    "sft_megatron_tp2": ["algo=sft", *OFFLINE, *MEGATRON],
    "dpo_megatron_tp2": ["algo=dpo", *OFFLINE, *MEGATRON],
    "grpo_megatron_tp2": ["algo=grpo", *RL, *MEGATRON],
    "ppo_megatron_tp2": ["algo=ppo", *RL, *MEGATRON],
}


def comparable(row: dict) -> dict:
    """A metric row without what measures time, memory or throughput."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "mem/")) and not k.endswith("tokens_per_s")}


def rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [comparable(json.loads(line)) for line in lines if line.strip()]


def run(tree: Path, out: Path, names: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(tree))
    for name in names:
        run_dir = out / name
        cmd = [sys.executable, "-m", "rltrain", *CONFIGS[name], *COMMON, f"hydra.run.dir={run_dir}"]
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        print(f"{name:22s} {status:8s} {time.monotonic() - started:6.1f}s", flush=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)


def compare(a: Path, b: Path, names: list[str]) -> bool:
    same_everywhere = True
    for name in names:
        rows_a, rows_b = rows(a / name), rows(b / name)
        if rows_a == rows_b:
            print(f"{name:22s} same    {len(rows_a)} rows, {sum(len(r) for r in rows_a)} values")
            continue
        same_everywhere = False
        print(f"{name:22s} DIFFER  {len(rows_a)} vs {len(rows_b)} rows")
        for i, (ra, rb) in enumerate(zip(rows_a, rows_b)):
            for key in sorted(set(ra) | set(rb)):
                if ra.get(key) != rb.get(key):
                    print(f"    row {i} {key}: {ra.get(key)!r} vs {rb.get(key)!r}")
    return same_everywhere


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run")
    p_run.add_argument("tree", type=Path)
    p_run.add_argument("out", type=Path)
    p_cmp = sub.add_parser("compare")
    p_cmp.add_argument("a", type=Path)
    p_cmp.add_argument("b", type=Path)
    p_both = sub.add_parser("both")
    p_both.add_argument("tree_a", type=Path)
    p_both.add_argument("tree_b", type=Path)
    p_both.add_argument("out", type=Path)
    for p in (p_run, p_cmp, p_both):
        p.add_argument("--only", nargs="*", choices=sorted(CONFIGS), help="a subset of the configurations")
    args = parser.parse_args()
    names = args.only or list(CONFIGS)
    if args.command == "run":
        run(args.tree.resolve(), args.out.resolve(), names)
        return 0
    if args.command == "compare":
        return 0 if compare(args.a, args.b, names) else 1
    run(args.tree_a.resolve(), args.out.resolve() / "a", names)
    run(args.tree_b.resolve(), args.out.resolve() / "b", names)
    return 0 if compare(args.out / "a", args.out / "b", names) else 1


if __name__ == "__main__":
    sys.exit(main())
