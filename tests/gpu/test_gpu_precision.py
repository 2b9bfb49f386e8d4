"""`trainer.precision` and `model.gradient_checkpointing` on CUDA: the checks of
tests/dist/backends/test_engine_precision.py (bf16 matmuls over fp32 weights, gradients and AdamW state in
`bf16-mixed`, fp32 log-probabilities and loss, checkpointing changes no number) with the engines
on the GPU. FSDP on one rank (autocast on CUDA), on two ranks sharing the GPU over gloo (sharded
start-up from the meta device with CUDA shards, `MixedPrecisionPolicy`), and megatron on one rank
(megatron's own CUDA autocast handling in its linear layers). Marked `gpu`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist" / "backends"))
import test_engine_precision as cpu_suite  # noqa: E402 - the shared worker and checks (spawned ranks import it too)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend, nproc", [("fsdp", 1), ("fsdp", 2), ("megatron", 1)])
def test_precision_and_activation_checkpointing_on_cuda(tiny_cache, backend, nproc):
    results = run_ranks(cpu_suite._run, cpu_suite._model_dir(), backend, "cuda", nproc=nproc, timeout_s=300, pg_timeout_s=60)
    cpu_suite.check(results, backend, ckpt_tol=1e-5)
