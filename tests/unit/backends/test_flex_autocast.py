"""The flex_attention a padding-free engine runs on CUDA receives query, key and value in one dtype
under bf16-mixed autocast (one unsharded rank), as sdpa does, and scores what sdpa scores; without
autocast nothing is cast, and a call without a mask still gets the model's own causal mask.

Forward only (CPU flex_attention has no backward), on the CPU's autocast: the rotary embedding
turns query and key fp32 there exactly as on CUDA (rltrain.backends.fsdp.micro_batches.flex_autocast)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from rltrain.backends.fsdp.hf_scoring import CompletionScorer, completion_positions
from rltrain.backends.fsdp.micro_batches import flex_autocast
from rltrain.backends.fsdp.micro_batches.flex_autocast import (
    AUTOCAST_FLEX_ATTENTION,
    switch_to_flex_attention,
)
from rltrain.backends.fsdp.micro_batches.layout import MicroBatchLayout
from rltrain.data.batch import SequenceBatch

CPU = torch.device("cpu")
BF16_AUTOCAST = partial(torch.autocast, "cpu", dtype=torch.bfloat16)


def _lm(tmp_path):
    from transformers import AutoModelForCausalLM

    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    # two query heads, one KV head: the GQA of the real checkpoints
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=96, cache_dir=str(tmp_path))
    return AutoModelForCausalLM.from_pretrained(build_tiny_model_dir(cfg, seed=5), dtype=torch.float32, attn_implementation="sdpa")


@pytest.fixture
def attention_dtypes(monkeypatch) -> list[tuple[torch.dtype, ...]]:
    """The (query, key, value) dtypes each flex_attention call of the model receives."""
    seen: list[tuple[torch.dtype, ...]] = []
    real = flex_autocast.flex_attention_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((query.dtype, key.dtype, value.dtype))
        return real(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(flex_autocast, "flex_attention_forward", spy)
    return seen


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_flex_under_autocast_gets_one_dtype_and_scores_as_sdpa(tmp_path, attention_dtypes):
    lm = _lm(tmp_path)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [15, 16, 17, 18]]
    batch = SequenceBatch.from_lists(prompts, [[20, 21, 22], [23], [24, 25, 26, 27, 28, 29], [33, 34]])
    layout = MicroBatchLayout.for_model(lm.config, 0, CPU, sharded=False, moe=False, padding_free=True)
    rects, order_N, _ = layout(batch)
    assert rects[0].document_ids_BT is not None  # one padding-free row, document-masked
    _, _, targets_N = completion_positions(batch)
    with torch.no_grad():
        sdpa_N = CompletionScorer(lm, autocast=BF16_AUTOCAST)(rects, targets_N, order_N=order_N)[0]
        switch_to_flex_attention(lm)
        assert lm.config._attn_implementation == AUTOCAST_FLEX_ATTENTION
        torch._dynamo.reset()  # static shapes: CPU inductor's flex template needs them
        flex_N = CompletionScorer(lm, autocast=BF16_AUTOCAST, flex_attention=True)(rects, targets_N, order_N=order_N)[0]
    assert len(attention_dtypes) == lm.config.num_hidden_layers
    assert set(attention_dtypes) == {(torch.bfloat16,) * 3}, attention_dtypes
    torch.testing.assert_close(flex_N, sdpa_N, rtol=0, atol=5e-3)  # bf16 attention both (measured 5e-4)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_without_autocast_nothing_is_cast_and_an_unmasked_call_is_causal(tmp_path, attention_dtypes):
    lm = _lm(tmp_path)
    ids_BT = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]])
    with torch.no_grad():
        sdpa_BTV = lm(input_ids=ids_BT, use_cache=False).logits
        switch_to_flex_attention(lm)
        torch._dynamo.reset()
        flex_BTV = lm(input_ids=ids_BT, use_cache=False).logits  # no mask: transformers builds a BlockMask
    assert set(attention_dtypes) == {(torch.float32,) * 3}, attention_dtypes
    torch.testing.assert_close(flex_BTV, sdpa_BTV, rtol=0, atol=1e-5)
