"""`python -m rltrain algo=sft backend.padding_free=true` on 2 FSDP ranks trains exactly as the
padded run does (losses and gradient norms within 1e-5, W&B offline receiving them), a bad value
or a backend without the key is refused before anything is built, and `scripts/bench_gpu.py
--padding-free` runs rltrain's rows padding-free and says so."""

from __future__ import annotations

import pytest
from cli import ROOT, SMALL_SFT_RUN_2_RANKS, python, rltrain, train_rows
from helpers import free_port
from wandb_reader import find_run_file, read_offline_run

pytestmark = pytest.mark.e2e

def test_padding_free_sft_matches_the_padded_run(shared_runs, tmp_path):
    padded_dir = shared_runs.get(*SMALL_SFT_RUN_2_RANKS)
    assert "padding_free: false" in (padded_dir / "config.yaml").read_text()
    rltrain(*SMALL_SFT_RUN_2_RANKS, "logger.wandb.mode=offline", "backend.padding_free=true", run_dir=tmp_path / "free")
    padded, free = train_rows(padded_dir), train_rows(tmp_path / "free")
    assert [r["step"] for r in free] == [r["step"] for r in padded] == [1, 2, 3]
    for a, b in zip(padded, free):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    wb = read_offline_run(find_run_file(tmp_path / "free"))
    assert wb["config"]["backend"]["padding_free"] is True
    assert [wb["history"][r["step"]]["loss"] for r in free] == [r["loss"] for r in free]


@pytest.mark.parametrize(
    "overrides",
    [["backend.padding_free=maybe"], ["backend=megatron", "backend.padding_free=true"]],
    ids=["not-a-bool", "megatron-has-no-such-key"],
)
def test_bad_padding_free_is_refused_before_any_model_is_built(tmp_path, overrides):
    run_dir = tmp_path / "run"
    proc = rltrain("algo=sft", *overrides, run_dir=run_dir, check=False, timeout=120)
    assert proc.returncode != 0
    assert "backend.padding_free" in proc.stderr + proc.stdout
    assert not run_dir.exists(), "nothing may be written for a config that does not compose"


def test_bench_gpu_padding_free_flag_on_cpu():
    """`--padding-free` with token-budget micro-batches (`--max-tokens`), as meant for the GPU."""
    proc = python("scripts/bench_gpu.py", "--only", "sft", "--steps", "1", "--warmup", "0", "--batch", "4",
                  "--micro", "2", "--no-trl", "--padding-free", "--max-tokens", "1024", "--port", str(free_port()),
                  timeout=600, env={"PYTHONPATH": str(ROOT)})  # this checkout's rltrain, whichever one the venv installed
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fp32, rltrain on fsdp, padding-free)" in proc.stdout and "micro-batches of <= 1024 tokens (TRL: 2 rows)" in proc.stdout, proc.stdout
    (sft,) = [line.split() for line in proc.stdout.splitlines() if line.startswith("rltrain sft")]
    assert float(sft[2]) > 0, sft
