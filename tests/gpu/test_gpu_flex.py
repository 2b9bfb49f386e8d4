"""Padding-free packing's CUDA branch, flex_attention, through the FSDP engine in `bf16-mixed`: on
one rank (autocast over fp32 weights) and on two ranks sharing the GPU over gloo (sharded,
`MixedPrecisionPolicy`), with and without compiled decoder layers. The model runs
`rltrain_flex_attention` (rltrain.backends.fsdp.micro_batches.flex_autocast), whose every call gets query, key and
value in bf16; its log-probabilities and SFT losses equal the padded engine's (sdpa) to bf16
round-off; training steps stay finite and move the weights. Marked `gpu`."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist" / "backends"))
import test_padding_free_engine as cpu_suite  # noqa: E402 - the model and the micro-batches (spawned ranks import it too)

pytestmark = pytest.mark.gpu


def _run(rank: int, world: int, model_dir, compile_layers: bool, device_type: str):
    """(attention dtypes seen, flex engine's results, padded engine's results) on this rank."""
    from rltrain.backends.fsdp.micro_batches import flex_autocast

    seen: list[tuple[str, ...]] = []
    real = flex_autocast.flex_attention_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((str(query.dtype), str(key.dtype), str(value.dtype)))
        return real(module, query, key, value, attention_mask, **kwargs)

    if not compile_layers:  # a compiled layer would trace the spy into its graph
        flex_autocast.flex_attention_forward = spy
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    flex = _train(rank, world, model_dir, device, padding_free=True, compile_layers=compile_layers)
    padded = _train(rank, world, model_dir, device, padding_free=False, compile_layers=False)
    return seen, flex, padded


def _train(rank: int, world: int, model_dir, device: torch.device, padding_free: bool, compile_layers: bool):
    import torch.distributed as dist

    from rltrain.algos.sft import sft_loss
    from rltrain.backends.fsdp.engine import FSDPEngine
    from rltrain.config.group_options import FSDPBackendConfig
    from rltrain.config.schema import OptimConfig

    engine = FSDPEngine(
        model_dir, FSDPBackendConfig(padding_free=padding_free, compile=compile_layers),
        OptimConfig(lr=1e-2, warmup_steps=0), 10, device, precision="bf16-mixed",
    )
    mbs = cpu_suite._micro_batches(rank, world)
    tokens = torch.tensor(float(sum(mb.num_completion_tokens for mb in mbs)))
    dist.all_reduce(tokens)
    for mb in mbs:
        mb.extras["global_tokens"] = tokens
    before = torch.cat([t.flatten().float().cpu() for _, t in sorted(engine.export_weights())])
    logps = [out.logps.values.cpu() for out in engine.forward_logps(mbs)]
    metrics = [engine.train_step(mbs, sft_loss) for _ in range(2)]
    after = torch.cat([t.flatten().float().cpu() for _, t in sorted(engine.export_weights())])
    return engine.lm.config._attn_implementation, logps, metrics, float((after - before).abs().max())


@pytest.mark.parametrize("nproc, compile_layers", [(1, False), (2, False), (1, True)], ids=["1rank", "2ranks", "compiled"])
def test_flex_attention_engine_on_cuda_equals_padded_in_bf16_mixed(tiny_cache, nproc, compile_layers):
    from rltrain.backends.fsdp.micro_batches.flex_autocast import AUTOCAST_FLEX_ATTENTION

    results = run_ranks(_run, cpu_suite._model_dir(), compile_layers, "cuda", nproc=nproc, timeout_s=600, pg_timeout_s=300)
    for seen, (attn, logps, metrics, moved), (p_attn, p_logps, p_metrics, _) in results:
        assert attn == AUTOCAST_FLEX_ATTENTION and p_attn == "sdpa"
        if not compile_layers:
            assert seen and set(seen) == {("torch.bfloat16",) * 3}, set(seen)
        for got, want in zip(logps, p_logps, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0.1)  # bf16 compute; a wrong mask moves them by O(1)
        for got, want in zip(metrics, p_metrics, strict=True):
            assert math.isfinite(got["loss"]) and math.isfinite(got["grad_norm"])
            assert got["loss"] == pytest.approx(want["loss"], rel=2e-2)
        assert moved > 0.0


def _many_widths(rank: int, world: int, model_dir, device_type: str):
    """(widths the model saw, each micro-batch's total, losses) for SFT steps on micro-batches of
    12 different totals between 789 and 1,020 tokens (as a token budget of 1,024 fills them),
    padding-free with compiled decoder layers."""
    from rltrain.algos.sft import sft_loss
    from rltrain.backends.fsdp.engine import FSDPEngine
    from rltrain.config.group_options import FSDPBackendConfig
    from rltrain.config.schema import OptimConfig
    from rltrain.data.batch import SequenceBatch

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    engine = FSDPEngine(
        model_dir, FSDPBackendConfig(padding_free=True, compile=True), OptimConfig(lr=1e-3, warmup_steps=0), 20, device,
        precision="bf16-mixed" if device_type == "cuda" else "fp32",
    )
    widths: list[int] = []
    engine.lm.model.register_forward_pre_hook(lambda _m, _a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    totals, losses = [], []
    for step in range(12):
        lengths = [260 + 7 * step + 3 * i for i in range(3)]
        mb = SequenceBatch.from_lists([[4 + i % 7] * (n // 4) for i, n in enumerate(lengths)],
                                      [[5 + (i + j) % 11 for j in range(n - n // 4)] for i, n in enumerate(lengths)])
        mb.extras["global_tokens"] = torch.tensor(float(mb.num_completion_tokens))
        totals.append(int(mb.tokens.lengths().sum()))
        losses.append(engine.train_step([mb], sft_loss)["loss"])
    return widths, totals, losses


def test_padding_free_steps_of_many_totals_compile_a_few_widths_and_finish(tiny_cache):
    """Packed rows of 12 different totals reach the compiled model at two widths (widths.packed_width:
    two compiles, not twelve), and every step finishes within the test's timeout."""
    from rltrain.backends.fsdp.micro_batches.widths import packed_width

    [(widths, totals, losses)] = run_ranks(_many_widths, cpu_suite._model_dir(), "cuda", nproc=1, timeout_s=600, pg_timeout_s=300)
    assert len(set(totals)) == 12 and widths == [packed_width(n) for n in totals] == [896] * 6 + [1024] * 6
    assert all(math.isfinite(loss) for loss in losses)
