"""Benchmark reward scoring: the built-in reward called in the trainer's process vs in killable
worker processes (rltrain.rewards.scoring), on the default GRPO step's shape.

    .venv/bin/python scripts/bench_rewards.py                    # a few seconds
    .venv/bin/python scripts/bench_rewards.py --prompts 64 --group 8 --workers 1,2 --repeats 50

Each row is one way of scoring one step's completions (`--prompts` groups of `--group`): the
direct call (what a thread-bound reward cost before the pool), and the pool with N workers at the
default chunking (one call per group). The pool's cost is the difference, to be read against a
default GRPO step (`time/step` in any run's metrics.jsonl).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace

from rltrain.rewards.builtin import addition_reward
from rltrain.rewards.scoring import RewardFn, RewardScorer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
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


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


if __name__ == "__main__":
    main()
