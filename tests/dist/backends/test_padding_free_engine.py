"""`backend.padding_free` through the FSDP engine: every micro-batch of unrelated sequences is one
packed row per model call, and the log-probabilities, SFT losses, gradient norms and updated
weights equal the padded layout's (one rectangle on 2 sharded ranks, length buckets on 1 rank)."""

from __future__ import annotations

import pytest
import torch
from helpers import run_ranks

pytestmark = pytest.mark.dist


def _model_dir():
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    return build_tiny_model_dir(cfg, seed=5)


def _micro_batches(rank: int, world: int):
    """Two micro-batches of this rank's ragged sequences (3 to 23 tokens, no prompt shared)."""
    from rltrain.data.batch import SequenceBatch

    batches = []
    for m in range(2):
        ids = [rank + world * (m * 3 + i) for i in range(3)]
        prompts = [[4 + (i % 7), 5 + i % 11, 6] [: 1 + i % 3] for i in ids]
        completions = [[7 + (i + j) % 13 for j in range((i * 5) % 20 + 1)] for i in ids]
        batches.append(SequenceBatch.from_lists(prompts, completions))
    return batches


def _both(rank: int, world: int, model_dir):
    """(padding-free engine's results, padded engine's results) on this rank."""
    return _train(rank, world, model_dir, True), _train(rank, world, model_dir, False)


def _train(rank: int, world: int, model_dir, padding_free: bool):
    import torch.distributed as dist

    from rltrain.algos.sft import sft_loss
    from rltrain.backends.fsdp.engine import FSDPEngine
    from rltrain.config.group_options import FSDPBackendConfig
    from rltrain.config.schema import OptimConfig

    engine = FSDPEngine(
        model_dir, FSDPBackendConfig(padding_free=padding_free), OptimConfig(lr=1e-2, warmup_steps=0), 10, torch.device("cpu")
    )
    calls = []
    engine.lm.model.register_forward_pre_hook(lambda _m, _a, kw: calls.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    mbs = _micro_batches(rank, world)
    tokens = torch.tensor(float(sum(mb.num_completion_tokens for mb in mbs)))
    dist.all_reduce(tokens)
    for mb in mbs:
        mb.extras["global_tokens"] = tokens
    logps = [out.logps.values for out in engine.forward_logps(mbs)]
    metrics = [engine.train_step(mbs, sft_loss) for _ in range(2)]
    params = torch.cat([t.flatten() for _, t in sorted(engine.export_weights())])
    return calls, logps, metrics, params


@pytest.mark.parametrize("nproc", [1, 2])
def test_padding_free_engine_equals_padded_engine(tiny_cache, nproc):
    model_dir = _model_dir()
    results = run_ranks(_both, model_dir, nproc=nproc, timeout_s=240)
    for rank, ((calls, logps, metrics, params), (p_calls, p_logps, p_metrics, p_params)) in enumerate(results):
        lengths = [int(mb.tokens.lengths().sum()) for mb in _micro_batches(rank, nproc)]
        assert calls == [(1, n) for n in lengths] * 3  # one packed row per micro-batch: scoring, 2 steps
        assert any(c[0] > 1 for c in p_calls)  # the padded engine had rectangles of several rows
        for got, want in zip(logps, p_logps, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        for got, want in zip(metrics, p_metrics, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-7)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        # AdamW's first steps move a weight by about lr * sign(gradient): fp32 round-off in a
        # near-zero gradient shows in the weights as a fraction of lr (1e-2), not of the weight.
        torch.testing.assert_close(params, p_params, rtol=0, atol=1e-2 * 1e-2)


def _compiled_layout_widths(rank: int, world: int, model_dir):
    """(the packed rows' widths, each micro-batch's total) of a compiled padding-free engine's layout."""
    from rltrain.backends.fsdp.engine import FSDPEngine
    from rltrain.config.group_options import FSDPBackendConfig
    from rltrain.config.schema import OptimConfig

    engine = FSDPEngine(
        model_dir, FSDPBackendConfig(padding_free=True, compile=True), OptimConfig(lr=1e-2, warmup_steps=0), 10, torch.device("cpu")
    )
    mbs = _micro_batches(rank, world)
    widths = [tuple(engine.layout(mb)[0][0].input_ids_BT.shape) for mb in mbs]
    return widths, [int(mb.tokens.lengths().sum()) for mb in mbs]


def test_a_compiled_engine_pads_its_packed_rows_to_a_few_widths(tiny_cache):
    """`backend.compile` compiles once per width: its packed rows take `packed_width` (the scores
    that gives are the unpadded row's: tests/unit/backends/test_padding_free.py)."""
    from rltrain.backends.fsdp.micro_batches.widths import packed_width

    [(widths, totals)] = run_ranks(_compiled_layout_widths, _model_dir(), nproc=1, timeout_s=240)
    assert widths == [(1, packed_width(n)) for n in totals] and all(packed_width(n) > n for n in totals)
