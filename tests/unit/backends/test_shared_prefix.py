"""Packed rows (each prompt once, completions behind a segment mask) score every completion token
exactly as the unpacked sequence does, gradients included, on both supported architectures."""

from __future__ import annotations

import pytest
import torch

from rltrain.backends.fsdp.hf_scoring import CompletionScorer, completion_positions
from rltrain.backends.fsdp.micro_batches.shared_prefix import (
    Rectangle,
    packed_rectangles,
    shared_prompt_groups,
)
from rltrain.data.batch import SequenceBatch

PAD = 0


def _lm(arch: str, tmp_path):
    from transformers import AutoModelForCausalLM

    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(
        arch=arch, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=96,
        tie_word_embeddings=arch == "qwen2", cache_dir=str(tmp_path),
    )
    return AutoModelForCausalLM.from_pretrained(build_tiny_model_dir(cfg, seed=3), dtype=torch.float32)


def _batch() -> SequenceBatch:
    """Three prompts, not adjacent, of different lengths; completions of 0 to 9 tokens; one prompt
    held by a single sequence; one prompt that is a prefix of another (not the same prompt)."""
    p1, p2, p3, p4 = [5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [5, 6]
    prompts = [p1, p2, p1, p3, p2, p1, p4, p2]
    completions = [[20, 21, 22], [23], [24, 25, 26, 27, 28, 29, 30, 31, 32], [33, 34], [], [35], [36, 37], [38, 39, 40]]
    return SequenceBatch.from_lists(prompts, completions)


def _plain_scores(lm, batch: SequenceBatch) -> torch.Tensor:
    rows, cols, targets = completion_positions(batch)
    ids_BT, _ = batch.tokens.to_padded(PAD)
    scorer = CompletionScorer(lm)
    return scorer([Rectangle(ids_BT, rows, cols)], targets)[0]


def test_groups_follow_identical_prompts():
    batch = _batch()
    assert shared_prompt_groups(batch) == [[0, 2, 5], [1, 4, 7], [3], [6]]
    alone = SequenceBatch.from_lists([[1, 2], [1, 3]], [[4], [5]])
    assert shared_prompt_groups(alone) is None


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("bucket_cost", [None, 1])
def test_packed_rows_score_like_unpacked_sequences(arch, bucket_cost, tmp_path):
    lm = _lm(arch, tmp_path)
    batch = _batch()
    _, _, targets = completion_positions(batch)
    rects, order_N = packed_rectangles(batch, shared_prompt_groups(batch), PAD, bucket_cost)
    assert len(rects) == 1 if bucket_cost is None else len(rects) > 1
    # every prompt once (3 + 6 + 1 + 2 tokens), each completion without its last token (14 tokens)
    assert sum(int((r.input_ids_BT != PAD).sum()) for r in rects) == 12 + 14
    scorer = CompletionScorer(lm)

    packed_N, entropy_N, _ = scorer(rects, targets, with_entropy=True, order_N=order_N)
    packed_N.sum().backward()
    packed_grads = [p.grad.clone() for p in lm.parameters()]
    lm.zero_grad()

    plain_N = _plain_scores(lm, batch)
    plain_N.sum().backward()
    plain_grads = [p.grad.clone() for p in lm.parameters()]

    assert packed_N.shape == (batch.num_completion_tokens,)
    torch.testing.assert_close(packed_N, plain_N, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(entropy_N).all() and (entropy_N > 0).all()
    for got, want in zip(packed_grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_padding_never_empties_an_attention_row():
    batch = SequenceBatch.from_lists([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [7]], [[8, 9, 10], [11], [12, 13]])
    (rect,), _ = packed_rectangles(batch, shared_prompt_groups(batch), PAD, None)
    assert rect.input_ids_BT.shape == (2, 5 + 2)  # prompt + 2 fed tokens; the short row is padded
    assert bool(rect.attention_mask_B1TT.any(dim=-1).all())


def test_groups_are_chunked_where_packing_costs_more_than_it_saves():
    from rltrain.backends.fsdp.micro_batches.shared_prefix import PackingCost

    cost = PackingCost(linear=1000.0, attention=1.0, max_row_tokens=64)
    prompt = list(range(1, 21))  # 20 tokens
    short = SequenceBatch.from_lists([prompt] * 4, [[30, 31, 32]] * 4)  # 4 rows of 23 vs 1 row of 28
    assert shared_prompt_groups(short, cost) == [[0, 1, 2, 3]]
    # Long completions: a packed row would pay ~length^2 attention for little shared work.
    long = SequenceBatch.from_lists([[5]] * 4, [[30] * 2000] * 4)
    assert shared_prompt_groups(long, PackingCost(linear=1000.0, attention=1.0, max_row_tokens=10_000)) is None
    # The row cap splits a group into chunks that fit.
    capped = SequenceBatch.from_lists([prompt] * 4, [[30] * 21] * 4)  # two completions per 64-token row
    assert shared_prompt_groups(capped, cost) == [[0, 1], [2, 3]]


def test_packing_cost_from_a_model_config():
    from transformers import Qwen2Config

    from rltrain.backends.fsdp.micro_batches.shared_prefix import PackingCost

    config = Qwen2Config(hidden_size=384, num_attention_heads=12, num_key_value_heads=4, intermediate_size=1024)
    cost = PackingCost.from_config(config)
    assert cost.linear == 384 * (384 + 2 * 128) + 384 * 384 + 3 * 384 * 1024
    assert cost.attention == 2 * 384
