"""Time sharing and the out-of-process engine change no number a GRPO run produces.

- For both backends, GRPO steps (FSDP: the shared GRPO_RUN's 4; Megatron: 2) with `placement.time_sharing=true` and `false` give identical
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
from cli import GRPO_RUN, QUICK, ranks_forked, rltrain, train_rows

# Separate-engine runs create rlsep-* directories and /dev/shm segments that the cleanup checks
# count: one pytest-xdist worker runs them all, one after the other (docs/testing.md, "Start-up").
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("separate_engine")]

# Megatron's pair; FSDP's runs are variants of the shared GRPO_RUN (tests/cli.py), whose plain
# run (time sharing off, the default) other tests read too.
MEGATRON = [
    "algo=grpo",
    "backend=megatron",
    "trainer.max_steps=2",
    "algo.prompts_per_step=4",
    "algo.group_size=4",
    "data.num_eval=4",
    *QUICK,
]
BASE = {"fsdp": GRPO_RUN, "megatron": MEGATRON}
STEPS = {"fsdp": 4, "megatron": 2}
PHASES = ("offload", "wake", "sync", "generate", "sleep", "onload", "train")


@pytest.fixture(scope="module")
def run(shared_runs, tmp_path_factory):
    """run(backend, *overrides) -> the run's training rows; each distinct run happens once per
    module, FSDP's plain run (no overrides) once per session."""
    done: dict[tuple[str, ...], list[dict]] = {}

    def _run(backend: str, *overrides: str) -> list[dict]:
        key = (backend, *overrides)
        if key not in done:
            if backend == "fsdp" and not overrides:
                run_dir = shared_runs.get(*GRPO_RUN)
            else:
                run_dir = tmp_path_factory.mktemp("ts")
                rltrain(*BASE[backend], *overrides, run_dir=run_dir, timeout=240)
            done[key] = train_rows(run_dir)
        return done[key]

    return _run


def _numbers(rows: list[dict]) -> list[tuple[float, float]]:
    return [(r["loss"], r["reward/mean"]) for r in rows]


# FSDP is `slow`: test_cli_ppo.py's time-sharing run (FSDP, with a critic) is a superset, in make test.
@pytest.mark.parametrize("backend", [pytest.param("fsdp", marks=pytest.mark.slow), "megatron"])
def test_time_sharing_changes_no_number(run, backend):
    plain = run(backend) if backend == "fsdp" else run(backend, "placement.time_sharing=false")
    shared = run(backend, "placement.time_sharing=true")
    assert len(plain) == len(shared) == STEPS[backend]
    assert _numbers(shared) == _numbers(plain)
    for row in shared:
        for phase in PHASES:
            assert row[f"time/phase/{phase}"] >= 0.0 and row[f"mem/{phase}"] > 0.0, (phase, row)
    assert shared[1]["time/phase/sync"] > 0.0  # from step 2 on, the weights of the step before
    assert "time/phase/offload" not in plain[0] and "time/phase/generate" in plain[0]


def test_separate_process_engine_matches_and_cleans_up(run):
    before = set(glob.glob(str(Path(tempfile.gettempdir()) / "rlsep-*")))
    forked = ranks_forked(by_vllm_server=True)
    separate = run("fsdp", "placement.time_sharing=true", "rollout.process=separate", "rollout.bucket_mb=1")
    # Its one rank is the warm launcher; the rollout process is forked warm, by the rank server's vLLM
    # server (docs/testing.md, "Warm ranks"; the reward's call workers are forked by the rank server).
    assert ranks_forked(by_vllm_server=True) == forked + 1
    assert len(separate) == STEPS["fsdp"]
    for row in separate:
        assert row["rollout/logprob_diff_max"] < 1e-3, row
    assert _numbers(separate) == _numbers(run("fsdp"))
    assert set(glob.glob(str(Path(tempfile.gettempdir()) / "rlsep-*"))) <= before
    assert glob.glob("/dev/shm/rltrain-w-*") == []
