"""A GRPO run with the separate rollout process on a /dev/shm as small as Docker's default (64 MiB)
ends at the first weight sync with one paragraph naming the size needed and the fix, exit 2, never
SIGBUS (docs/time-sharing-and-sync.md, "The separate-process engine")."""

from __future__ import annotations

import pytest
from cli import QUICK, rltrain
from helpers import mounted_tmpfs

# Separate-engine runs create rlsep-* directories and /dev/shm segments that the cleanup checks
# count: one pytest-xdist worker runs them all, one after the other (docs/testing.md, "Start-up").
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("separate_engine")]


@pytest.fixture
def docker_sized_shm():
    with mounted_tmpfs("64m") as where:
        yield where


def test_small_shm_is_a_clear_error_at_the_first_sync(tiny_cache, tmp_path, docker_sized_shm):
    common = [
        "algo=grpo", "rollout=vllm", "rollout.process=separate", *QUICK, "algo.prompts_per_step=4",
        "algo.group_size=4", "data.num_eval=4", "trainer.max_steps=2",
    ]
    env = {"RLTRAIN_SHM_DIR": str(docker_sized_shm)}
    proc = rltrain(*common, run_dir=tmp_path / "run", env=env, check=False, timeout=400)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "cannot allocate 2 buckets of 64 MiB" in proc.stderr and "needs 128 MiB per rank" in proc.stderr
    assert "--shm-size" in proc.stderr and "rollout.bucket_mb" in proc.stderr
    assert "Traceback" not in proc.stderr
    # The fix the message names works: smaller buckets fit.
    rltrain(*common, "rollout.bucket_mb=16", run_dir=tmp_path / "fits", env=env, timeout=400)
