"""scripts/bench_vlm.py at the smallest sizes, so it cannot rot between benchmark runs: rltrain's
row (`rollout=hf`, the cheapest engine: the rows differ only in `rollout=`, and vLLM with images
runs in tests/e2e/test_cli_vision.py), and TRL's row beside it (TRL is pinned with the test tools,
requirements/; where it is missing, as on a GPU machine without its wheel, the script says so and
prints rltrain's row alone). Timings are printed, never asserted."""

from __future__ import annotations

import pytest
from cli import python

pytestmark = pytest.mark.e2e

COLUMNS = 8  # tokens/s, step s, rollout s, train s, sync s, completion len, peak GiB, tokens/s vs TRL


@pytest.mark.slow  # a vision GRPO run beside TRL's: both sides' mechanisms run in make test elsewhere (test_cli_vision_rl.py, bench_gpu's TRL rows)
def test_bench_vlm_prints_rltrains_row_and_trl_beside_it():
    proc = python("scripts/bench_vlm.py", "--rollout", "hf", "--steps", "1", "--warmup", "0", "--prompts", "2",
                  "--group", "2", "--max-new-tokens", "4", "--image-size", "28", timeout=600, warm=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.rsplit(None, COLUMNS)[0]: line.rsplit(None, COLUMNS)[1:] for line in proc.stdout.splitlines()
            if line.startswith(("rltrain GRPO", "TRL GRPOTrainer"))}
    ours, trl = "rltrain GRPO (rollout=hf)", "TRL GRPOTrainer (use_vllm=False)"
    tokens_per_s, step_s, rollout_s, train_s, sync_s, length, peak_gib = map(float, rows[ours][:7])
    assert min(tokens_per_s, step_s, rollout_s, train_s, peak_gib) > 0 and sync_s >= 0, rows[ours]
    assert 0 < length <= 4, rows[ours]  # at most --max-new-tokens sampled
    assert list(rows) == [ours, trl], proc.stdout
    assert rows[trl][-1] == "1.00x" and float(rows[trl][0]) > 0, proc.stdout
    assert float(rows[ours][-1].rstrip("x")) > 0, proc.stdout
    assert f"paired per-step speed-up of {ours}" in proc.stdout, proc.stdout


def test_bench_vlm_names_an_unknown_rollout_engine():
    proc = python("scripts/bench_vlm.py", "--rollout", "vllm,sglang", timeout=120, warm=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--rollout vllm,sglang: choose from vllm,hf, comma-separated" in proc.stderr, proc.stderr
