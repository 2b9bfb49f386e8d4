"""Benchmark generating ahead (`placement.max_staleness`, docs/async.md): the default GRPO loop
synchronous and with k = 1 and k = 2, vLLM in its own process, for each split of this machine's
cores between the trainer and the engine.

    .venv/bin/python scripts/bench_async.py                      # ~15 min on 2 cores
    .venv/bin/python scripts/bench_async.py --steps 20 --splits 1/1

Each run is `python -m rltrain` on the embedded default (its SFT start built once and cached) for
`--steps` steps without evaluation or checkpoints; the first `--warmup` steps are left out and the
medians of the rest are reported. `alone` is max(rollout, train) of the synchronous run with the
same threads, where each half runs with the other idle: the best an overlapped step can do. The
best split is the one whose fastest asynchronous step is lowest; the table says which.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(run_dir: Path, steps: int, k: int, trainer_threads: int, engine_threads: int) -> list[dict]:
    cmd = [
        sys.executable, "-m", "rltrain", f"trainer.max_steps={steps}", "trainer.eval_every=0", "trainer.save_every=0",
        "logger.wandb.mode=disabled", "trainer.progress=lines", "rollout=vllm", "rollout.process=separate",
        f"placement.max_staleness={k}", f"trainer.num_threads={trainer_threads}", f"rollout.num_threads={engine_threads}",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r]


def medians(rows: list[dict], warmup: int) -> dict[str, float]:
    timed = rows[warmup:]
    out = {key: statistics.median(r.get(key, 0.0) for r in timed) for key in ("time/step", "time/rollout", "time/train")}
    out["idle"] = statistics.median(r.get("time/wait_rollout", 0.0) / r["time/step"] for r in timed) if "time/wait_rollout" in timed[0] else 0.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    cores = len(os.sched_getaffinity(0))
    default_splits = sorted({f"{cores}/{cores}", f"{max(1, cores // 2)}/{max(1, cores - cores // 2)}"})
    parser.add_argument("--splits", default=",".join(default_splits), help="trainer/engine threads, comma-separated")
    args = parser.parse_args()
    results: dict[str, dict[int, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        for split in args.splits.split(","):
            trainer_threads, engine_threads = (int(x) for x in split.split("/"))
            results[split] = {}
            for k in (0, 1, 2):
                rows = run(Path(tmp) / f"{split.replace('/', '-')}-k{k}", args.steps, k, trainer_threads, engine_threads)
                results[split][k] = medians(rows, args.warmup)
                print(f"split {split}, k={k}: {results[split][k]['time/step']:.3f} s/step", file=sys.stderr, flush=True)
    print(f"\nthe default GRPO step, {args.steps} steps (median after {args.warmup}), {cores} cores, "
          "vLLM in its own process")
    header = f"{'trainer/engine threads':<24}{'mode':<8}{'step s':>9}{'rollout s':>11}{'train s':>9}{'idle':>7}{'vs sync':>9}{'vs alone':>10}"
    print(header)
    best = min(results, key=lambda s: min(results[s][k]["time/step"] for k in (1, 2)))
    for split, by_k in results.items():
        sync = by_k[0]
        alone = max(sync["time/rollout"], sync["time/train"])
        for k, m in by_k.items():
            mode = "sync" if k == 0 else f"k={k}"
            print(f"{split + (' (best)' if split == best else ''):<24}{mode:<8}{m['time/step']:>9.3f}{m['time/rollout']:>11.3f}"
                  f"{m['time/train']:>9.3f}{m['idle']:>7.0%}{m['time/step'] / sync['time/step']:>8.2f}x{m['time/step'] / alone:>9.2f}x")
    best_sync = min(by_k[0]["time/step"] for by_k in results.values())
    best_async = min(results[best][k]["time/step"] for k in (1, 2))
    print(f"best asynchronous step ({best}) / best synchronous step (any split): {best_async / best_sync:.2f}x")
    print("idle: the trainer's share of the step spent waiting for its batch (time/wait_rollout / time/step).")
    print("vs alone: step time / max(rollout, train) of the synchronous run with the same threads (target <= 1.15).")


if __name__ == "__main__":
    main()
