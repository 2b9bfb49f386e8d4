"""What a user reads on the console of a real run: GRPO with the vLLM engine on 2 FSDP ranks and W&B
offline. One line per logged step, out of the total, from rank 0 only; a closing line naming the run
directory and one naming the offline W&B run; and none of the library output a user cannot act on
(rltrain.runtime.library_noise, W&B's Weave advert, torch's all_gather_into_tensor deprecation)."""

from __future__ import annotations

import pytest
from cli import SMALL_MODEL, rltrain

pytestmark = pytest.mark.e2e

NOISE = ("Loading weights", "Writing model shards", "checkpoint shards", "Triton", "reduce_op", "Weave", "is deprecated")


def test_a_two_rank_grpo_run_prints_progress_once_and_no_library_noise(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    proc = rltrain(
        "algo=grpo", "model=tiny", *SMALL_MODEL, "algo.prompts_per_step=4", "algo.group_size=2",
        "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=2", "trainer.save_every=0",
        "trainer.progress=lines", "trainer.nproc=2", "logger.wandb.mode=offline",
        run_dir=run_dir, timeout=400,
    )
    console = proc.stdout + proc.stderr
    step_lines = [line.split(" | ")[0] for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert step_lines == ["step 0/2", "step 1/2", "step 2/2", "step 2/2"], console  # evals at 0 and 2
    assert f"rltrain: finished step 2; run directory {run_dir}" in proc.stdout
    (offline_dir,) = (run_dir / "wandb").glob("offline-run-*")
    assert proc.stdout.count(f"upload it with `wandb sync {offline_dir}`") == 1
    assert [word for word in NOISE if word in console] == [], console
