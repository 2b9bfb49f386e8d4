"""Time sharing and the out-of-process engine change no number a GRPO run produces.

- For both backends, 3 GRPO steps with `placement.time_sharing=true` and `false` give identical
  `loss` and `reward/mean` rows with the same seed (DESIGN invariant 4), and every step of the
  time-shared run reports each phase's time and memory.
- `rollout.process=separate` (vLLM in a child process, weights through the shared-memory
  transport) keeps `rollout/logprob_diff_max` below 1e-3 (invariant 3), here together with time
  sharing (sleep/wake cross the control channel, the sync streams the host copy), gives the same
  rows as the in-process engine, and leaves no endpoint directory or shared memory behind.
"""

from __future__ import annotations

import glob
import tempfile
from pathlib import Path

import pytest
from cli import QUICK, rltrain, train_rows

pytestmark = pytest.mark.e2e

SMALL = [
    "algo=grpo",
    "trainer.max_steps=3",
    "algo.prompts_per_step=4",
    "algo.group_size=4",
    "data.num_eval=4",
    *QUICK,
]
PHASES = ("offload", "wake", "sync", "generate", "sleep", "onload", "train")


@pytest.fixture(scope="module")
def run(tiny_cache, tmp_path_factory):
    """run(*overrides) -> the run's training rows; each distinct run happens once per module."""
    done: dict[tuple[str, ...], list[dict]] = {}

    def _run(*overrides: str) -> list[dict]:
        if overrides not in done:
            run_dir = tmp_path_factory.mktemp("ts")
            rltrain(*SMALL, *overrides, run_dir=run_dir, timeout=240)
            done[overrides] = train_rows(run_dir)
        return done[overrides]

    return _run


def _numbers(rows: list[dict]) -> list[tuple[float, float]]:
    return [(r["loss"], r["reward/mean"]) for r in rows]


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_time_sharing_changes_no_number(run, backend):
    plain = run(f"backend={backend}", "placement.time_sharing=false")
    shared = run(f"backend={backend}", "placement.time_sharing=true")
    assert len(plain) == len(shared) == 3
    assert _numbers(shared) == _numbers(plain)
    for row in shared:
        for phase in PHASES:
            assert row[f"time/phase/{phase}"] >= 0.0 and row[f"mem/{phase}"] > 0.0, (phase, row)
    assert shared[1]["time/phase/sync"] > 0.0  # from step 2 on, the weights of the step before
    assert "time/phase/offload" not in plain[0] and "time/phase/generate" in plain[0]


def test_separate_process_engine_matches_and_cleans_up(run):
    before = set(glob.glob(str(Path(tempfile.gettempdir()) / "rlsep-*")))
    separate = run(
        "backend=fsdp", "placement.time_sharing=true", "rollout.process=separate", "rollout.bucket_mb=1"
    )
    assert len(separate) == 3
    for row in separate:
        assert row["rollout/logprob_diff_max"] < 1e-3, row
    assert _numbers(separate) == _numbers(run("backend=fsdp", "placement.time_sharing=false"))
    assert set(glob.glob(str(Path(tempfile.gettempdir()) / "rlsep-*"))) <= before
    assert glob.glob("/dev/shm/rltrain-w-*") == []
