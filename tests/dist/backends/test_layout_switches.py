"""The FSDP layout switches the benchmarks ablate (`backend.length_buckets`, `backend.share_prompts`)
are read by the engine: built through the benchmark scripts' own classes, each switch changes the
model calls a micro-batch makes (rectangles and rows) and leaves the log-probabilities unchanged.
A flag the engine stopped reading would show here as identical calls."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from helpers import run_ranks

pytestmark = pytest.mark.dist

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def _model_dir():
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    return build_tiny_model_dir(cfg, seed=5)


def _scored(engine, micro_batches) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """(input shape of every decoder call, log-probabilities) of scoring `micro_batches`."""
    calls: list[tuple[int, ...]] = []
    hook = engine.lm.model.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    logps = torch.cat([out.logps.values for out in engine.forward_logps(micro_batches)])
    hook.remove()
    return calls, logps


def _ablations(rank: int, world: int, model_dir):
    sys.path.insert(0, str(SCRIPTS))
    from bench_dpo import RltrainDPO, make_pairs
    from bench_sft import RltrainSFT, make_rows

    sft_rows = make_rows(8)
    sft = {
        buckets: _scored(bench.engine, [bench.batches[0][0]])
        for buckets in (True, False)
        for bench in [RltrainSFT(model_dir, sft_rows, batch=8, total_steps=1, buckets=buckets)]
    }
    pairs = make_pairs(4)
    dpo = {}
    for packing in (True, False):
        bench = RltrainDPO(model_dir, pairs, pairs_per_step=4, total_steps=1, buckets=False, packing=packing)
        micro, _ = bench._micro(bench.pairs, 0, 1, 4)
        dpo[packing] = _scored(bench.policy, micro)
    return sft, dpo


def test_benchmark_ablations_change_the_engine_layout(tiny_cache):
    sft, dpo = run_ranks(_ablations, _model_dir(), nproc=1, timeout_s=240)[0]
    (bucketed_calls, bucketed_logps), (plain_calls, plain_logps) = sft[True], sft[False]
    assert len(bucketed_calls) > 1  # lengths of 30-250 tokens: several rectangles of similar lengths
    assert plain_calls == [(8, max(c[1] for c in bucketed_calls))]  # one rectangle, padded to the longest
    torch.testing.assert_close(bucketed_logps, plain_logps, rtol=0, atol=1e-5)
    (packed_calls, packed_logps), (unpacked_calls, unpacked_logps) = dpo[True], dpo[False]
    # Pairs whose prompt is worth sharing (rltrain/backends/fsdp/micro_batches/shared_prefix.py, PackingCost) are
    # one row; with sharing off every pair is two rows, its prompt computed twice.
    assert sum(rows for rows, _ in packed_calls) < 8
    assert sum(rows for rows, _ in unpacked_calls) == 8
    torch.testing.assert_close(packed_logps, unpacked_logps, rtol=0, atol=1e-5)
