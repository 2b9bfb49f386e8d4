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

The CPU columns are the seconds of CPU per timed step of each part of the run's process tree, read
from /proc when the warm-up ends and when the last step is logged: the API server (vLLM's HTTP
process, `rollout=server` only), the engine (the separate engine's process or the server's engine
core) and the trainer (the rest: launcher, ranks, the server's guard). On a machine with few cores
their sum against the step time shows where a slower step's time went (docs/rollout-servers.md,
"Measured"). A process that ends between the two readings is left out.
"""

from __future__ import annotations

import argparse
import json
import os
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


CPU_PARTS = ("api server", "engine", "trainer")


def part_of(comm: str, cmdline: str) -> str:
    """Which part of a run a process is (see the module doc)."""
    api = ("vllm.entrypoints.openai.api_server", "rltrain.rollout.server.api_server")
    if any(name in cmdline for name in api) and "rltrain.rollout.server.guard" not in cmdline:
        return "api server"
    if "EngineCore" in comm or "EngineCore" in cmdline or "rltrain.rollout.separate_child" in cmdline:
        return "engine"
    return "trainer"


def tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    """Every live process under `root` (itself included): its part and its CPU seconds so far."""
    tick = os.sysconf("SC_CLK_TCK")
    procs: dict[int, tuple[int, str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        procs[int(entry)] = (int(fields[1]), part_of(comm, cmdline), (int(fields[11]) + int(fields[12])) / tick)
    under, grew = {root}, True
    while grew:
        found = {pid for pid, (ppid, _, _) in procs.items() if ppid in under} - under
        under |= found
        grew = bool(found)
    return {pid: procs[pid][1:] for pid in under if pid in procs}


def cpu_per_step(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], steps: int) -> dict[str, float]:
    totals = dict.fromkeys(CPU_PARTS, 0.0)
    for pid, (part, cpu) in after.items():
        totals[part] += cpu - before.get(pid, (part, 0.0))[1]
    return {f"cpu/{part}": total / max(1, steps) for part, total in totals.items()}


def logged_steps(metrics: Path) -> int:
    try:
        return sum(1 for line in metrics.read_text().splitlines() if '"loss"' in line)
    except OSError:
        return 0


def run(run_dir: Path, steps: int, warmup: int, engine: list[str], k: int, extra: list[str]) -> tuple[list[dict], float, dict[str, float]]:
    cmd = [
        sys.executable, "-m", "rltrain", f"trainer.max_steps={steps}", "trainer.eval_every=0", "trainer.save_every=0",
        "logger.wandb.mode=disabled", "trainer.progress=lines", *engine, f"placement.max_staleness={k}", *extra,
        f"hydra.run.dir={run_dir}",
    ]
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics, log = run_dir / "metrics.jsonl", run_dir.with_suffix(".log")
    started = time.perf_counter()
    readings: dict[int, dict[int, tuple[str, float]]] = {}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            done = logged_steps(metrics)
            for mark in (warmup, steps):
                if done >= mark and mark not in readings:
                    readings[mark] = tree_cpu(proc.pid)
            time.sleep(0.05)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{log.read_text()[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    cpu = cpu_per_step(readings.get(warmup, {}), readings.get(steps, {}), steps - warmup)
    return [r for r in rows if "loss" in r], wall, cpu


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
                    rows, wall, cpu = run(Path(tmp) / f"{name.replace(' ', '')}-k{k}-{attempt}", args.steps, args.warmup, engine, k, args.extra)
                    runs.setdefault((name, k), []).append(({**medians(rows, args.warmup), **cpu}, wall))
                    print(f"{name}, k={k}: {runs[(name, k)][-1][0]['time/step']:.3f} s/step", file=sys.stderr, flush=True)
    results = {
        row: ({key: statistics.median(m[key] for m, _ in done) for key in done[0][0]}, statistics.median(w for _, w in done))
        for row, done in runs.items()
    }
    repeats = f", medians of {args.repeat} runs" if args.repeat > 1 else ""
    print(f"\nthe default GRPO step, {args.steps} steps (median after {args.warmup}{repeats}){' ' + ' '.join(args.extra) if args.extra else ''}")
    print(f"{'engine':<12}{'mode':<7}{'step s':>9}{'rollout s':>11}{'train s':>9}{'sync s':>9}{'wall s':>9}{'vs separate':>13}"
          f"{'cpu trainer':>13}{'cpu engine':>12}{'cpu api':>9}")
    for (name, k), (m, wall) in results.items():
        base = results[("separate", k)][0]["time/step"]
        print(f"{name:<12}{'sync' if k == 0 else f'k={k}':<7}{m['time/step']:>9.3f}{m['time/rollout']:>11.3f}{m['time/train']:>9.3f}"
              f"{m['time/sync']:>9.3f}{wall:>9.1f}{m['time/step'] / base:>12.2f}x"
              f"{m['cpu/trainer']:>13.3f}{m['cpu/engine']:>12.3f}{m['cpu/api server']:>9.3f}")
    print("vs separate: step time / the same mode's step with rollout.process=separate (goal <= 1.1x).")
    print("wall s: the whole run, the engine's or the server's start included.")
    print("cpu: CPU seconds per timed step of the trainer's processes, the engine's, vLLM's API server (module doc).")


if __name__ == "__main__":
    main()
