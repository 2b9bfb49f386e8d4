"""Weights loaded between decoding steps (`placement.weight_update=in_flight`, docs/async.md "Weights
in flight") in real runs: GRPO on one rank, vLLM in its own process driven step by step.

- Streaming (`placement.stream=true`): every step trains `algo.prompts_per_step` complete groups, no
  token is more than `placement.max_staleness` versions behind the trainer that trains it (the
  per-token versions, `batches.jsonl`), every prompt of the data stream is trained exactly once,
  and the metrics of the mode are logged.
- Without streaming, step t's batch is its own prompts, the ones generating ahead between batches
  takes, and step 1 (sampled by version 0 in both) gives the same samples and the same row.
- SIGKILL after a checkpoint and a restart: the prompts submitted ahead and not trained are the
  checkpoint's, generated first on resume, so the run still trains every prompt once.
- `placement.deterministic=true`: the same command twice gives the same samples and equal metric
  rows (timings and the engine's idle share aside), with versions loaded mid-sequence.
"""

from __future__ import annotations

import json
import signal

import pytest
from cli import SMALL_MODEL, comparable, kill_when, read_metrics, rltrain, train_rows

# One xdist worker runs every separate-engine test: their cleanup checks count rlsep-* directories.
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("separate_engine")]

STEPS, K, PER_STEP, GROUP = 4, 1, 4, 2
STREAM = [
    "algo=grpo", "model=tiny", *SMALL_MODEL, f"algo.prompts_per_step={PER_STEP}", f"algo.group_size={GROUP}", "algo.max_new_tokens=12",
    "data.num_eval=4", "data.eval_seed=0", f"trainer.max_steps={STEPS}", "trainer.save_every=0", "trainer.eval_every=2",
    "trainer.progress=lines", "logger.wandb.mode=disabled", "rollout=vllm", "rollout.process=separate",
    f"placement.max_staleness={K}", "placement.weight_update=in_flight", "placement.stream=true",
]
DETERMINISTIC = [*STREAM, "placement.deterministic=true", "placement.update_lag_steps=3"]
IN_FLIGHT = [*STREAM, "placement.stream=false"]
BETWEEN_BATCHES = [*STREAM, "placement.stream=false", "placement.weight_update=between_batches"]


def batches(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "batches.jsonl").read_text().splitlines()]


def timeless(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "rollout/engine_idle_frac"} for r in comparable(rows)]


def test_streamed_batches_keep_every_token_within_the_bound(shared_runs):
    run_dir = shared_runs.get(*STREAM, timeout=600)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        t = r["step"]
        low, high = r["rollout/token_version_min"], r["rollout/token_version_max"]
        assert max(0, t - 1 - K) <= low <= high <= t - 1, r  # sampled within the bound, never by a future version
        assert r["rollout/staleness_max"] == t - 1 - low <= K and 0 <= r["rollout/staleness_mean"] <= r["rollout/staleness_max"], r
        assert 1 <= r["rollout/versions_per_sequence_max"] <= high - low + 1, r
        assert 0.0 <= r["rollout/engine_idle_frac"] <= 1.0 and r["rollout/regenerated"] >= 0, r
        assert r["time/wait_rollout"] >= 0 and 0 < r["rollout/is_weight_mean"] <= 2.0, r  # tis, the default with k >= 1
    # rollout/tokens_per_s: the batches' tokens over the engine's busy seconds (time/rollout), both summed so far
    tokens = busy = 0.0
    for r in rows:
        tokens, busy = tokens + r["rollout/response_length_mean"] * PER_STEP * GROUP, busy + r["time/rollout"]
        assert r["rollout/tokens_per_s"] == pytest.approx(tokens / busy, rel=1e-9), r
    ledger = batches(run_dir)
    assert [(b["step"], b["sampled_by"]) for b in ledger] == [(r["step"], r["rollout/token_version_min"]) for r in rows]
    prompts = [p for b in ledger for p in b["prompts"]]
    assert all(len(b["prompts"]) == PER_STEP for b in ledger) and len(set(prompts)) == len(prompts)
    # the same data stream as the deterministic run's: every prompt trained once, in whatever order groups completed
    assert sorted(prompts) == sorted(p for b in batches(shared_runs.get(*DETERMINISTIC, timeout=600)) for p in b["prompts"])


def test_deterministic_in_flight_runs_repeat_exactly(shared_runs, tmp_path):
    first = shared_runs.get(*DETERMINISTIC, timeout=600)
    rltrain(*DETERMINISTIC, run_dir=tmp_path / "again", timeout=600)
    rows, again = read_metrics(first), read_metrics(tmp_path / "again")
    assert timeless(rows) == timeless(again)
    assert batches(first) == batches(tmp_path / "again")
    trained = train_rows(first)
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    # a version was loaded while sequences were being sampled: some sequence holds tokens of two
    assert max(r["rollout/versions_per_sequence_max"] for r in trained) >= 2
    assert all(r["step"] - 1 - r["rollout/token_version_min"] <= K for r in trained)


def test_a_killed_stream_resumes_without_skipping_a_prompt(shared_runs, tmp_path):
    args = [*STREAM, "trainer.save_every=2"]
    run_dir = tmp_path / "killed"
    kill_when(args, run_dir, run_dir / "checkpoints" / "step_00000002", signal.SIGKILL, timeout=600)
    rltrain(*args, run_dir=run_dir, timeout=600)
    assert [r["step"] for r in train_rows(run_dir)] == list(range(1, STEPS + 1))
    assert all(r["step"] - 1 - r["rollout/token_version_min"] <= K for r in train_rows(run_dir))
    prompts = [p for b in batches(run_dir) for p in b["prompts"]]
    full = [p for b in batches(shared_runs.get(*STREAM, timeout=600)) for p in b["prompts"]]
    assert len(set(prompts)) == len(prompts) and sorted(prompts) == sorted(full)


def test_in_flight_batches_are_the_steps_own_prompts_with_the_same_first_samples(shared_runs):
    in_flight, between = shared_runs.get(*IN_FLIGHT, timeout=600), shared_runs.get(*BETWEEN_BATCHES, timeout=600)
    assert [b["prompts"] for b in batches(in_flight)] == [b["prompts"] for b in batches(between)]
    rows = train_rows(in_flight)
    for r in rows:
        assert max(0, r["step"] - 1 - K) <= r["rollout/token_version_min"] <= r["rollout/token_version_max"] <= r["step"] - 1, r
    first, reference = comparable(rows)[0], comparable(train_rows(between))[0]
    shared = set(first) & set(reference)
    assert {"loss", "reward/mean", "rollout/response_length_mean", "rollout/logprob_diff_max"} <= shared
    assert {k: first[k] for k in shared} == {k: reference[k] for k in shared}
