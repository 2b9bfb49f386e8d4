"""Benchmark `rollout=server` (docs/rollout-servers.md): the default GRPO step with one spawned vLLM
API server against today's `rollout=vllm rollout.process=separate` (goal <= 1.1x), both synchronous
and generating one step ahead (k = 1, the overlap scripts/bench_async.py measures).

    .venv/bin/python scripts/bench_fleet.py                 # ~10 min on 2 cores
    .venv/bin/python scripts/bench_fleet.py --steps 10 --warmup 2 --repeat 3   # medians of 3 interleaved runs
    .venv/bin/python scripts/bench_fleet.py --steps 10 --warmup 2 --extra trainer.nproc=1

Each run is `python -m rltrain` on the embedded default for `--steps` steps without evaluation or
checkpoints; the first `--warmup` steps are left out and the medians of the rest reported (with `--repeat N`, the
runs of every row interleaved and the median of their medians: a slow spell of a shared machine
then hits every row). The
server's start is not in any step (it is in the run's wall time, reported apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINES = {
    "separate": ["rollout=vllm", "rollout.process=separate"],
    "server x1": ["rollout=server", "rollout.servers.spawn=1"],
}


def run(run_dir: Path, steps: int, engine: list[str], k: int, extra: list[str]) -> tuple[list[dict], float]:
    cmd = [
        sys.executable, "-m", "rltrain", f"trainer.max_steps={steps}", "trainer.eval_every=0", "trainer.save_every=0",
        "logger.wandb.mode=disabled", "trainer.progress=lines", *engine, f"placement.max_staleness={k}", *extra,
        f"hydra.run.dir={run_dir}",
    ]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r], wall


def medians(rows: list[dict], warmup: int) -> dict[str, float]:
    timed = rows[warmup:]
    return {key: statistics.median(r.get(key, 0.0) for r in timed) for key in ("time/step", "time/rollout", "time/train", "time/sync")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1, help="runs per row, interleaved; the median of their medians")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides added to every run")
    args = parser.parse_args()
    runs: dict[tuple[str, int], list[tuple[dict[str, float], float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        for attempt in range(args.repeat):
            for k in (0, 1):
                for name, engine in ENGINES.items():
                    rows, wall = run(Path(tmp) / f"{name.replace(' ', '')}-k{k}-{attempt}", args.steps, engine, k, args.extra)
                    runs.setdefault((name, k), []).append((medians(rows, args.warmup), wall))
                    print(f"{name}, k={k}: {runs[(name, k)][-1][0]['time/step']:.3f} s/step", file=sys.stderr, flush=True)
    results = {
        row: ({key: statistics.median(m[key] for m, _ in done) for key in done[0][0]}, statistics.median(w for _, w in done))
        for row, done in runs.items()
    }
    repeats = f", medians of {args.repeat} runs" if args.repeat > 1 else ""
    print(f"\nthe default GRPO step, {args.steps} steps (median after {args.warmup}{repeats}){' ' + ' '.join(args.extra) if args.extra else ''}")
    print(f"{'engine':<12}{'mode':<7}{'step s':>9}{'rollout s':>11}{'train s':>9}{'sync s':>9}{'wall s':>9}{'vs separate':>13}")
    for (name, k), (m, wall) in results.items():
        base = results[("separate", k)][0]["time/step"]
        print(f"{name:<12}{'sync' if k == 0 else f'k={k}':<7}{m['time/step']:>9.3f}{m['time/rollout']:>11.3f}{m['time/train']:>9.3f}"
              f"{m['time/sync']:>9.3f}{wall:>9.1f}{m['time/step'] / base:>12.2f}x")
    print("vs separate: step time / the same mode's step with rollout.process=separate (goal <= 1.1x).")
    print("wall s: the whole run, the engine's or the server's start included.")


if __name__ == "__main__":
    main()
