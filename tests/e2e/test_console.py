"""What a user reads on the console of a real run: GRPO with the vLLM engine on 2 FSDP ranks and W&B
offline. One line per logged step, out of the total, from rank 0 only; a closing line naming the run
directory and one naming the offline W&B run; and none of the library output a user cannot act on
(rltrain.runtime.library_noise, W&B's Weave advert, torch's all_gather_into_tensor deprecation)."""

from __future__ import annotations

import pytest
from cli import GRPO_RUN_2_RANKS

pytestmark = pytest.mark.e2e

NOISE = ("Loading weights", "Writing model shards", "checkpoint shards", "Triton", "reduce_op", "Weave", "is deprecated")


# The shared 2-rank GRPO run (tests/cli.py), which test_cli_grpo.py reads too.
def test_a_two_rank_grpo_run_prints_progress_once_and_no_library_noise(shared_runs):
    run_dir, stdout, stderr = shared_runs.get_with_output(*GRPO_RUN_2_RANKS)
    console = stdout + stderr
    step_lines = [line.split(" | ")[0] for line in stdout.splitlines() if line.startswith("step ")]
    assert step_lines == ["step 0/2", "step 1/2", "step 2/2", "step 2/2"], console  # evals at 0 and 2
    assert f"rltrain: finished step 2; run directory {run_dir}" in stdout
    (offline_dir,) = (run_dir / "wandb").glob("offline-run-*")
    assert stdout.count(f"upload it with `wandb sync {offline_dir}`") == 1
    assert [word for word in NOISE if word in console] == [], console
