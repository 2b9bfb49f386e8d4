"""Benchmark reward scoring: the built-in reward called in the trainer's process vs in killable
worker processes (rltrain.rewards.scoring), on the default GRPO step's shape; then the code reward's
sandboxed executions per second, each sandbox mode side by side (rltrain/rewards/sandbox).

    .venv/bin/python scripts/bench_rewards.py                    # a few seconds
    .venv/bin/python scripts/bench_rewards.py --prompts 64 --group 8 --workers 1,2 --repeats 50
    .venv/bin/python scripts/bench_rewards.py --executions 256 --sandbox-workers 1,2,4 --url http://host:8080

First table: one way of scoring one step's completions (`--prompts` groups of `--group`) per row:
the direct call, and the pool with N workers at the default chunking (one call per group); the
pool's cost is the difference, to be read against `time/step`. Second table: `--executions`
test cases (a stdin/stdout program each) through `run_tests`, per mode and `reward.sandbox.workers`;
`--url` adds a SandboxFusion service (mode=remote).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace

from rltrain.config.schema import SandboxConfig
from rltrain.rewards.builtin import addition_reward
from rltrain.rewards.code import run_tests
from rltrain.rewards.sandbox.settings import CodeSettings
from rltrain.rewards.scoring import RewardFn, RewardScorer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--executions", type=int, default=64, help="sandboxed test cases per measurement")
    parser.add_argument("--sandbox-workers", default="1,4", help="comma-separated reward.sandbox.workers")
    parser.add_argument("--modes", default="bwrap,rlimits", help="comma-separated local sandbox modes")
    parser.add_argument("--url", default=None, help="a SandboxFusion service to measure as well (mode=remote)")
    args = parser.parse_args()
    pool_table(args)
    print()
    sandbox_table(args)


def pool_table(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    problems = [(rng.randrange(100), rng.randrange(100)) for _ in range(args.prompts)]
    prompts = [f"{a}+{b}=" for a, b in problems for _ in range(args.group)]
    answers = [str(a + b) for a, b in problems for _ in range(args.group)]
    completions = [str(int(a) + rng.choice((-1, 0, 0, 1))) for a in answers]
    groups = [p for p in range(args.prompts) for _ in range(args.group)]

    rows = [("direct call", median_ms(lambda: addition_reward(prompts, completions, answers), args.repeats))]
    fn = RewardFn("addition_reward", "rltrain.rewards.builtin:addition_reward", addition_reward, 1.0)
    for workers in (int(w) for w in args.workers.split(",")):
        cfg = SimpleNamespace(timeout_s=60.0, workers=workers, chunk_size=0, chunk_spans_groups=False, on_failure=0.0,
                              max_failure_frac=0.25)
        scorer = RewardScorer([fn], cfg, collective_timeout_s=600.0)
        try:
            scorer.score(prompts, completions, {"answer": answers}, groups)  # the workers' start-up
            ms = median_ms(lambda s=scorer: s.score(prompts, completions, {"answer": answers}, groups), args.repeats)
        finally:
            scorer.close()
        rows.append((f"pool, {workers} worker(s), a call per group", ms))
    print(f"scoring {len(completions)} completions ({args.prompts} groups of {args.group}), median of {args.repeats}")
    print(f"{'mode':<40} {'ms per step':>12}")
    for name, ms in rows:
        print(f"{name:<40} {ms:>12.2f}")


def sandbox_table(args: argparse.Namespace) -> None:
    """Executions per second: `--executions` cases of one completion each, all passing, per mode."""
    io = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    completions = ["a, b = map(int, input().split())\nprint(a + b)"] * args.executions
    modes = [(m, None) for m in args.modes.split(",")] + ([("remote", args.url)] if args.url else [])
    rows = []
    for mode, url in modes:
        for workers in (int(w) for w in args.sandbox_workers.split(",")):
            settings = CodeSettings(sandbox=SandboxConfig(mode=mode, url=url, workers=workers))
            run_tests(completions[:1], {"input_output": [io]}, settings)  # the interpreter's probe, once
            start = time.perf_counter()
            scored = run_tests(completions, {"input_output": [io] * args.executions}, settings)
            seconds = time.perf_counter() - start
            if sum(s.passed for s in scored) != args.executions:
                raise SystemExit(f"mode={mode}: only {sum(s.passed for s in scored)} of {args.executions} executions passed")
            rows.append((mode, workers, args.executions / seconds))
    print(f"sandboxed executions ({args.executions} per row, a stdin/stdout program each)")
    print(f"{'mode':<10} {'workers':>8} {'executions/s':>14}")
    for mode, workers, rate in rows:
        print(f"{mode:<10} {workers:>8} {rate:>14.1f}")


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


if __name__ == "__main__":
    main()
