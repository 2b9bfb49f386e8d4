"""In-flight updates and streaming over vLLM API servers (`rollout=server placement.weight_update=in_flight
placement.stream=true`, docs/async.md "Weights in flight") in real GRPO runs over the session's two
URL-given servers:

- every step trains `algo.prompts_per_step` complete groups, no token more than
  `placement.max_staleness` versions behind the trainer that trains it (the per-token versions the
  servers report), every prompt of the data stream trained once, the mode's metrics logged;
- a trainer SIGKILLed mid-stream (its requests still out on the servers) and resumed: the steps its
  checkpoint holds are kept as they were, the ones after it train exactly the prompts the
  checkpoint says were submitted and not trained, and no prompt is trained twice.
"""

from __future__ import annotations

import json
import signal

import pytest
from cli import QUICK, SMALL_MODEL, kill_when, rltrain, train_rows

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("rollout_servers")]

STEPS, K, PER_STEP = 4, 1, 4
STREAM = [
    "algo=grpo", *QUICK, *SMALL_MODEL, f"algo.prompts_per_step={PER_STEP}", "algo.group_size=2", "algo.max_new_tokens=12",
    f"trainer.max_steps={STEPS}", "rollout=server", f"placement.max_staleness={K}", "placement.weight_update=in_flight",
    "placement.stream=true", "data.num_eval=8",
]


def urls(rollout_servers) -> str:
    return f"rollout.servers.urls=[{','.join(s.url for s in rollout_servers['servers'])}]"


def ledger(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "batches.jsonl").read_text().splitlines()]


def test_streamed_batches_over_servers_keep_every_token_within_the_bound(shared_runs, rollout_servers):
    run_dir = shared_runs.get(*STREAM, urls(rollout_servers), timeout=600)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        t = r["step"]
        low, high = r["rollout/token_version_min"], r["rollout/token_version_max"]
        assert max(0, t - 1 - K) <= low <= high <= t - 1, r  # within the bound, never a version not yet pushed
        assert r["rollout/version_min"] == low and r["rollout/version_max"] == high, r  # the fleet's view of the batch
        assert r["rollout/staleness_max"] == t - 1 - low and 0 <= r["rollout/staleness_mean"] <= r["rollout/staleness_max"], r
        assert 1 <= r["rollout/versions_per_sequence_max"] <= high - low + 1, r
        assert 0.0 <= r["rollout/engine_idle_frac"] <= 1.0 and r["rollout/regenerated"] >= 0, r
        assert r["rollout/servers_up"] == 2 and r["rollout/server_failures"] == 0 and r["sync/bytes"] > 0, r
    batches = ledger(run_dir)
    assert [(b["step"], b["sampled_by"]) for b in batches] == [(r["step"], r["rollout/token_version_min"]) for r in rows]
    prompts = [p for b in batches for p in b["prompts"]]
    assert all(len(b["prompts"]) == PER_STEP for b in batches) and len(set(prompts)) == len(prompts)


def test_a_trainer_killed_mid_stream_resumes_without_losing_a_step_or_training_a_prompt_twice(shared_runs, rollout_servers, tmp_path):
    args = [*STREAM, urls(rollout_servers), "trainer.save_every=2"]
    run_dir = tmp_path / "killed"
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    kill_when(args, run_dir, checkpoint, signal.SIGKILL, timeout=600)
    before = ledger(run_dir)
    pending = json.loads((checkpoint / "rollouts" / "rank0.json").read_text())["pending"]
    rltrain(*args, run_dir=run_dir, timeout=600)
    assert [r["step"] for r in train_rows(run_dir)] == list(range(1, STEPS + 1))
    after = ledger(run_dir)
    assert after[:2] == before[:2]  # the checkpointed steps, as they were trained
    # the steps after it: exactly the prompts the checkpoint holds as submitted and not trained
    assert sorted(p for b in after[2:] for p in b["prompts"]) == sorted(p for row in pending for p in row["global_index"])
    prompts = [p for b in after for p in b["prompts"]]
    full = [p for b in ledger(shared_runs.get(*STREAM, urls(rollout_servers), timeout=600)) for p in b["prompts"]]
    assert len(set(prompts)) == len(prompts) and sorted(prompts) == sorted(full)
    assert all(r["step"] - 1 - r["rollout/token_version_min"] <= K for r in train_rows(run_dir))
