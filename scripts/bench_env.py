"""Benchmark concurrent environment calls (`env.max_concurrency`, docs/environments.md): one GRPO
step of multi-turn episodes with an environment whose every step waits on the network (0.2 s)
against one that does not, and with some episodes whose step hangs against none.

    .venv/bin/python scripts/bench_env.py                          # 512 episodes of 3 turns, a few minutes
    .venv/bin/python scripts/bench_env.py --repeat 3               # medians of 3 runs per training row
    .venv/bin/python scripts/bench_env.py --prompts 4 --group 2   # a quick look
    .venv/bin/python scripts/bench_env.py --pool-only              # N hung calls vs one, in seconds

Each row is `python -m rltrain algo=grpo model=tiny env=python env.cls=bench_env:<Env>` (the tiny
model, this module as the environment) for one step of `--prompts` x `--group` episodes of exactly
3 turns; `time/rollout` is read from the run's metrics. The rows to compare: `waits` against
`instant` (the extra should stay under 1.5 x 3 x 0.2 s when every episode is in flight at once), and
`hangs` (the episodes of every prompt whose answer is a multiple of 10 hang in their first step, `env.timeout_s=2`)
against `instant` (the extra should be about one `env.timeout_s`, however many hang). A first table
times `CallPool.run` alone: 512 calls at once with 0, 1 or 25 of them hanging; a second the episode
loop alone with an engine stand-in that replies at once (the environment's side only: on a busy
machine the training rows' generation time varies by more than the waits being measured).
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TURNS = 3
WAIT_S = 0.2


class Instant:
    """Three steps, then done; the reward is the reply's length (any deterministic number)."""

    def reset(self, **row: Any) -> str:
        self.steps, self.row = 0, row
        return " go:"

    def step(self, text: str) -> tuple[str | None, float, bool]:
        self.steps += 1
        return (None if self.steps >= TURNS else " again:"), float(len(text)), self.steps >= TURNS


class Waits(Instant):
    """Every step waits WAIT_S, as on a network call."""

    def step(self, text: str) -> tuple[str | None, float, bool]:
        time.sleep(WAIT_S)
        return super().step(text)


class Hangs(Instant):
    """The first step of some episodes never returns (the row's answer picks them)."""

    def step(self, text: str) -> tuple[str | None, float, bool]:
        if self.steps == 0 and int(str(self.row["answer"]).strip()) % HANG_EVERY == 0:
            time.sleep(10_000)
        return super().step(text)


HANG_EVERY = 10


def pool_call(hang: bool) -> int:
    """The pool-level rows' call: returns at once, or never."""
    if hang:
        time.sleep(10_000)
    return 1


def pool_table(calls: int, hung: list[int], timeout_s: float) -> list[tuple[str, float, int]]:
    """(row, seconds, timeouts): `calls` calls at once in one CallPool (one worker, as env.workers=1),
    `n` of them hanging, for each n of `hung`."""
    from rltrain.runtime.call_pool import Call, CallPool

    pool = CallPool(1, ["bench_env:pool_call"], "bench", calls)
    rows = []
    try:
        pool.start()
        pool.run([Call("bench_env:pool_call", {"hang": False})], timeout_s)  # the worker's start-up
        for n in hung:
            started = time.perf_counter()
            results = pool.run([Call("bench_env:pool_call", {"hang": i < n}) for i in range(calls)], timeout_s)
            rows.append((f"{n} of {calls} calls hang", time.perf_counter() - started, sum(r.failure == "timeout" for r in results)))
    finally:
        pool.close()
    return rows


def loop_table(episodes: int, concurrency: list[int], timeout_s: float) -> list[tuple[str, float, int]]:
    """(row, seconds, timeouts): the episode loop alone (rltrain/envs/episodes.py, the real
    environment workers) with an engine stand-in that replies at once, so the environment's side is
    all that is timed: `episodes` episodes of 3 turns per environment and concurrency."""
    from types import SimpleNamespace

    from rltrain.data.prompt_data import PromptRow
    from rltrain.envs.episodes import EpisodeRunner
    from rltrain.envs.user_env import HostedEnvironments
    from rltrain.models.tokenizer import build_char_tokenizer
    from rltrain.rollout.base import Completion, SamplingSettings

    tokenizer = build_char_tokenizer()
    eos = tokenizer.eos_token_id

    def generate(prompts: list[list[int]], sampling: SamplingSettings) -> list[Completion]:
        return [Completion(i, [5, 6, eos], [-0.1, -0.1, -0.1], True) for i in range(len(prompts))]

    rows = [PromptRow([7, 8], f"{i}+0=", {"answer": str(i)}) for i in range(episodes)]
    table = []
    for name, c in [("Instant", max(concurrency)), *(("Waits", c) for c in concurrency), ("Hangs", max(concurrency))]:
        env_cfg = SimpleNamespace(
            cls=f"bench_env:{name}", max_turns=TURNS, max_tokens_per_turn=4, max_total_tokens=256, timeout_s=timeout_s,
            workers=1, max_concurrency=c,
        )
        reward_cfg = SimpleNamespace(on_failure=0.0, max_failure_frac=1.0)
        runner = EpisodeRunner(env_cfg, reward_cfg, tokenizer, 4, 600.0, HostedEnvironments(env_cfg, reward_cfg, tokenizer))
        try:
            runner.run(rows[:1], 1, SamplingSettings(stop_token_ids=[eos]), "warm", generate)  # the worker's start-up
            started = time.perf_counter()
            played = runner.run(rows, 1, SamplingSettings(stop_token_ids=[eos]), "bench", generate)
            table.append((f"{name}, max_concurrency={c}", time.perf_counter() - started, played.failures.timeouts))
        finally:
            runner.close()
    return table


def run(run_dir: Path, env: str, prompts: int, group: int, concurrency: int, extra: list[str]) -> dict:
    cmd = [
        sys.executable, "-m", "rltrain", "algo=grpo", "model=tiny", "env=python", f"env.cls=bench_env:{env}", f"env.max_turns={TURNS}",
        "env.max_tokens_per_turn=4", f"env.max_concurrency={concurrency}", f"algo.prompts_per_step={prompts}",
        f"algo.group_size={group}", "trainer.max_steps=1", "trainer.eval_every=0", "data.num_eval=4", "trainer.save_every=0",
        "logger.wandb.mode=disabled", "trainer.progress=lines", f"hydra.run.dir={run_dir}", *extra,
    ]
    paths = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **paths})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return next(r for r in rows if "loss" in r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--concurrency", default="512,256", help="env.max_concurrency values for the waiting env, comma-separated")
    parser.add_argument("--hung", default="0,1,25", help="the pool table: how many of --calls calls hang, comma-separated")
    parser.add_argument("--calls", type=int, default=512, help="the pool table: calls at once")
    parser.add_argument("--timeout", type=float, default=2.0, help="the pool table: env.timeout_s")
    parser.add_argument("--pool-only", action="store_true", help="only the pool table (seconds, no training run)")
    parser.add_argument("--loop-only", action="store_true", help="the pool and episode-loop tables (no training run)")
    parser.add_argument("--repeat", type=int, default=1, help="the training table: runs per row, their median reported")
    args = parser.parse_args()
    print(f"CallPool.run of {args.calls} calls at once, timeout_s={args.timeout:g}")
    print(f"{'calls':<48} {'seconds':>15} {'timeouts':>9}")
    for name, seconds, timeouts in pool_table(args.calls, [int(n) for n in args.hung.split(",")], args.timeout):
        print(f"{name:<48} {seconds:>15.3f} {timeouts:>9d}")
    if args.pool_only:
        return
    episodes = args.prompts * args.group
    concurrency = [int(c) for c in args.concurrency.split(",")]
    print(f"\nthe episode loop alone, {episodes} episodes of {TURNS} turns, an engine stand-in, env.timeout_s={args.timeout:g}")
    print(f"{'environment':<48} {'seconds':>15} {'timeouts':>9}")
    for name, seconds, timeouts in loop_table(episodes, concurrency, args.timeout):
        print(f"{name:<48} {seconds:>15.2f} {timeouts:>9d}")
    if args.loop_only:
        return
    print()
    table: list[tuple[str, float, float, float]] = []
    rows: list[tuple[str, str, int, list[str]]] = [(f"instant, max_concurrency={episodes}", "Instant", episodes, [])]
    rows += [(f"waits {WAIT_S:g} s a step, max_concurrency={c}", "Waits", c, []) for c in (int(c) for c in args.concurrency.split(","))]
    rows.append((f"hangs (every {HANG_EVERY}th answer), timeout_s=2", "Hangs", episodes, ["env.timeout_s=2", "reward.max_failure_frac=1.0"]))
    measured: dict[str, list[dict]] = {name: [] for name, *_ in rows}
    with tempfile.TemporaryDirectory(prefix="bench-env-") as tmp:
        for attempt in range(args.repeat):  # rows interleaved, so a slow spell of the machine hits all of them
            for i, (name, env, concurrency, extra) in enumerate(rows):
                measured[name].append(run(Path(tmp) / f"{i}-{attempt}", env, args.prompts, args.group, concurrency, extra))
    base = statistics.median(r["time/rollout"] for r in measured[rows[0][0]])
    for name, *_ in rows:
        rollout = statistics.median(r["time/rollout"] for r in measured[name])
        table.append((name, rollout, rollout - base, statistics.median(r["env/timeouts"] for r in measured[name])))
    print(f"one GRPO step, {episodes} episodes ({args.prompts} prompts x {args.group}) of {TURNS} turns, 1 rank"
          + (f", medians of {args.repeat} runs" if args.repeat > 1 else ""))
    print(f"{'environment':<48} {'time/rollout s':>15} {'extra s':>9} {'env/timeouts':>13}")
    for name, rollout, extra, timeouts in table:
        print(f"{name:<48} {rollout:>15.2f} {extra:>9.2f} {timeouts:>13g}")
    print(f"target: waits at full concurrency <= {1.5 * TURNS * WAIT_S:.2f} s extra; hangs ~ one env.timeout_s extra")


if __name__ == "__main__":
    main()
