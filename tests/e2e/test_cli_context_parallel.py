"""`backend.cp=2` runs end to end (`slow`: the mechanism's parity is tests/dist/backends/test_context_parallel.py).

SFT, DPO, KTO, RM, GRPO and PPO: 5 steps at cp=2 on 2 ranks log the metrics of cp=1 on 1 rank (one replica each,
so the same samples and batches) within 1e-5, and a GRPO run with 4096 new tokens trains with cp=2
and activation checkpointing, the rollout engine's and the trainer's log-probabilities agreeing
within 1e-3. docs/long-sequences.md.
"""

from __future__ import annotations

import pytest
from cli import SMALL_MODEL, read_metrics, rltrain

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOL = 1e-5
RUN = [
    *SMALL_MODEL, "trainer.max_steps=5", "trainer.eval_every=0", "trainer.save_every=0", "logger.wandb.mode=disabled",
    "trainer.progress=lines", "trainer.log_every=1",
]
ALGOS = {
    "sft": ["algo=sft", "trainer.global_batch_size=8", "trainer.micro_batch_size=4"],
    "dpo": ["algo=dpo", "trainer.global_batch_size=8", "trainer.micro_batch_size=4"],
    "grpo": ["algo=grpo", "model=tiny", "algo.prompts_per_step=4", "algo.group_size=4"],
    "ppo": ["algo=ppo", "model=tiny", "algo.prompts_per_step=4", "algo.group_size=2"],
    "kto": ["algo=kto", "model=tiny", "trainer.global_batch_size=8", "trainer.micro_batch_size=4"],
    "rm": ["algo=rm", "trainer.global_batch_size=8", "trainer.micro_batch_size=4"],
}


def _compared(row: dict) -> dict:
    """The numbers a run computes (not its timings, memory or throughput)."""
    return {
        k: v for k, v in row.items()
        if isinstance(v, (int, float)) and not k.startswith(("time/", "mem/")) and not k.endswith("tokens_per_s")
    }


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_cp2_logs_every_metric_of_cp1(tmp_path, algo):
    one = rltrain(*ALGOS[algo], *RUN, run_dir=tmp_path / "cp1", timeout=900)
    assert one.returncode == 0, one.stdout + one.stderr
    two = rltrain(*ALGOS[algo], *RUN, "trainer.nproc=2", "backend.cp=2", run_dir=tmp_path / "cp2", timeout=900)
    assert two.returncode == 0, two.stdout + two.stderr
    rows_1, rows_2 = read_metrics(tmp_path / "cp1"), read_metrics(tmp_path / "cp2")
    assert len([r for r in rows_2 if "loss" in r]) == 5
    for want, got in zip(rows_1, rows_2, strict=True):
        want, got = _compared(want), _compared(got)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=TOL, abs=TOL), (algo, want["step"], key)


def test_a_4096_token_grpo_trains_with_cp2_and_checkpointing(tmp_path):
    """Completions of up to 4096 tokens split over 2 ranks. The untrained tiny model ends its own
    completions (its end token is one of 128), so they are long but rarely 4096 tokens: the memory
    of one 16k-token sequence at cp 1 and 2 is scripts/bench_long.py's."""
    run = rltrain(
        "algo=grpo", "model=tiny", *SMALL_MODEL, "algo.max_new_tokens=4096", "algo.prompts_per_step=1",
        "algo.group_size=2", "data.num_eval=2", "trainer.max_steps=2", "trainer.nproc=2", "backend.cp=2",
        "model.gradient_checkpointing=true", "model.max_position_embeddings=4608", "trainer.eval_every=0",
        "trainer.save_every=0", "logger.wandb.mode=disabled", "trainer.progress=lines",
        run_dir=tmp_path / "run", timeout=1500,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 2
    assert max(r["rollout/response_length_mean"] for r in rows) > 20
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in rows)
