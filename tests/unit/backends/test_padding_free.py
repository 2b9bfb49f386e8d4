"""Padding-free micro-batches (one packed row, document-masked attention) score every completion
token, give the SFT loss and the parameter gradients exactly as the padded rectangle does (fp32,
1e-6), on both supported architectures; the flex_attention mask that CUDA runs is the same mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rltrain.algos.sft import sft_loss
from rltrain.backends.base import PolicyOutput
from rltrain.backends.fsdp.hf_scoring import CompletionScorer, completion_positions
from rltrain.backends.fsdp.micro_batches.attention_masks import (
    block_mask,
    dense_mask_mod,
    document_causal_mask,
    document_causal_mask_mod,
    model_attention_mask,
    use_flex_attention,
)
from rltrain.backends.fsdp.micro_batches.flex_autocast import switch_to_flex_attention
from rltrain.backends.fsdp.micro_batches.layout import MicroBatchLayout
from rltrain.backends.fsdp.micro_batches.padding_free import padding_free_rectangle
from rltrain.backends.fsdp.micro_batches.shared_prefix import (
    PackingCost,
    packed_rectangles,
    shared_prompt_groups,
)
from rltrain.backends.fsdp.micro_batches.widths import packed_width
from rltrain.data.batch import SequenceBatch
from rltrain.data.ragged import Ragged

PAD = 0
CPU = torch.device("cpu")


def _lm(arch: str, tmp_path):
    from transformers import AutoModelForCausalLM

    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(
        arch=arch, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=96,
        tie_word_embeddings=arch == "qwen2", cache_dir=str(tmp_path),
    )
    return AutoModelForCausalLM.from_pretrained(build_tiny_model_dir(cfg, seed=3), dtype=torch.float32, attn_implementation="sdpa")


def _ragged_batch() -> SequenceBatch:
    """Unrelated prompts (no two alike) and completions of 0 to 9 tokens: 3 to 15 tokens a sequence."""
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [5, 6], [15, 16, 17, 18]]
    completions = [[20, 21, 22], [23], [24, 25, 26, 27, 28, 29, 30, 31, 32], [33, 34], []]
    return SequenceBatch.from_lists(prompts, completions)


def _layout(lm, padding_free: bool, moe: bool = False) -> MicroBatchLayout:
    # sharded=True: one rectangle without padding-free (no length buckets), as on FSDP ranks
    return MicroBatchLayout.for_model(lm.config, PAD, CPU, sharded=True, moe=moe, padding_free=padding_free)


def _score(scorer: CompletionScorer, layout: MicroBatchLayout, batch: SequenceBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logps_N, parameter gradients of the SFT loss) for one layout."""
    scorer.lm.zero_grad()
    rects, order_N, _ = layout(batch)
    _, _, targets_N = completion_positions(batch)
    logps_N, _, _ = scorer(rects, targets_N, order_N=order_N)
    batch.extras["global_tokens"] = batch.num_completion_tokens
    loss, _ = sft_loss(PolicyOutput(Ragged.from_lengths(logps_N, batch.completion_lens())), batch)
    loss.backward()
    return logps_N.detach(), loss.detach(), [p.grad.clone() for p in scorer.lm.parameters()]


def test_one_row_with_restarting_positions():
    batch = _ragged_batch()
    rect = padding_free_rectangle(batch)
    total = int(batch.tokens.lengths().sum())
    assert rect.input_ids_BT.shape == (1, total)  # every token once, no padding
    assert rect.position_ids_BT[0].tolist() == [p for n in batch.tokens.lengths().tolist() for p in range(n)]
    assert rect.document_ids_BT[0].tolist() == [i for i, n in enumerate(batch.tokens.lengths().tolist()) for _ in range(n)]
    # the position that predicts each scored token is the one just before it, in ragged order
    _, _, targets_N = completion_positions(batch)
    assert (rect.rows_N == 0).all()
    assert torch.equal(rect.input_ids_BT[0, rect.cols_N + 1], targets_N)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_padding_free_scores_loss_and_grads_equal_padded(arch, tmp_path):
    lm = _lm(arch, tmp_path)
    scorer = CompletionScorer(lm)
    batch = _ragged_batch()
    rects, _, _ = _layout(lm, padding_free=True)(batch)
    assert len(rects) == 1 and rects[0].input_ids_BT.shape[0] == 1 and rects[0].document_ids_BT is not None

    free_N, free_loss, free_grads = _score(scorer, _layout(lm, padding_free=True), batch)
    padded_N, padded_loss, padded_grads = _score(scorer, _layout(lm, padding_free=False), batch)

    assert free_N.shape == (batch.num_completion_tokens,)
    torch.testing.assert_close(free_N, padded_N, rtol=0, atol=1e-6)
    torch.testing.assert_close(free_loss, padded_loss, rtol=0, atol=1e-6)
    assert any(g.abs().max() > 0 for g in padded_grads)
    for got, want in zip(free_grads, padded_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_packed_widths_are_few_and_waste_at_most_a_quarter():
    """A compiled model compiles once per width: every total up to 16k tokens meets one of about
    two dozen widths, each a multiple of flex_attention's 128-token block and at most a quarter
    filler (hand-worked: 600 -> 640, 1000 -> 1024, 3000 -> 3072, 16000 -> 16384)."""
    assert [packed_width(n) for n in (1, 30, 128, 129, 600, 1000, 3000, 16000)] == [128, 128, 128, 256, 640, 1024, 3072, 16384]
    widths = [packed_width(n) for n in range(1, 16385)]
    assert all(w >= n and w % 128 == 0 for n, w in enumerate(widths, start=1))
    assert all(w - n <= max(127, n / 4) for n, w in enumerate(widths, start=1))
    assert len(set(widths)) == 24


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_row_padded_to_its_width_scores_as_the_unpadded_row(arch, tmp_path):
    """The filler is a document of its own after every real token: the scores, the loss and the
    gradients are the unpadded row's."""
    lm = _lm(arch, tmp_path)
    scorer = CompletionScorer(lm)
    batch = _ragged_batch()
    rounded = MicroBatchLayout.for_model(lm.config, PAD, CPU, sharded=True, moe=False, padding_free=True, round_packed_widths=True)
    rect = rounded(batch)[0][0]
    total = int(batch.tokens.lengths().sum())
    assert rect.input_ids_BT.shape == (1, packed_width(total)) and packed_width(total) > total
    assert (rect.input_ids_BT[0, total:] == PAD).all() and (rect.document_ids_BT[0, total:] == len(batch)).all()

    got_N, got_loss, got_grads = _score(scorer, rounded, batch)
    want_N, want_loss, want_grads = _score(scorer, _layout(lm, padding_free=True), batch)
    torch.testing.assert_close(got_N, want_N, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=1e-6)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_shared_prompt_rows_padded_to_their_width_score_as_unpadded(tmp_path):
    """Shared-prompt rectangles rounded the same way (padding sees only itself) score as before."""
    lm = _lm("qwen2", tmp_path)
    scorer = CompletionScorer(lm)
    shared = SequenceBatch.from_lists([[5, 6, 7]] * 2 + [[8, 9]] * 2, [[20, 21], [22, 23, 24], [25], [26, 27, 28, 29]])
    groups = shared_prompt_groups(shared)
    exact, exact_order_N = packed_rectangles(shared, groups, PAD, None)
    rounded, rounded_order_N = packed_rectangles(shared, groups, PAD, None, round_width=True)
    assert rounded[0].input_ids_BT.shape == (2, packed_width(exact[0].input_ids_BT.shape[1])) != exact[0].input_ids_BT.shape
    _, _, targets_N = completion_positions(shared)
    with torch.no_grad():
        want_N = scorer(exact, targets_N, order_N=exact_order_N)[0]
        got_N = scorer(rounded, targets_N, order_N=rounded_order_N)[0]
    torch.testing.assert_close(got_N, want_N, rtol=0, atol=1e-6)


def test_without_the_document_mask_the_numbers_differ(tmp_path):
    """The parity above is not vacuous: the same packed row under plain causal attention (later
    sequences seeing earlier ones) scores differently."""
    lm = _lm("qwen2", tmp_path)
    scorer = CompletionScorer(lm)
    batch = _ragged_batch()
    rect = padding_free_rectangle(batch)
    _, _, targets_N = completion_positions(batch)
    with torch.no_grad():
        masked_N = scorer([rect], targets_N)[0]
        rect.document_ids_BT = torch.zeros_like(rect.document_ids_BT)  # one document: plain causal
        leaky_N = scorer([rect], targets_N)[0]
    assert (masked_N - leaky_N).abs().max() > 1e-3


def test_shared_prompts_still_pack_and_moe_is_never_padding_free(tmp_path):
    lm = _lm("qwen2", tmp_path)
    shared = SequenceBatch.from_lists([[5, 6, 7]] * 3, [[20, 21], [22], [23, 24, 25]])
    rects, order_N, _ = _layout(lm, padding_free=True)(shared)
    assert rects[0].attention_mask_B1TT is not None and rects[0].document_ids_BT is None and order_N is not None
    rects, _, padding_mask_BT = _layout(lm, padding_free=True, moe=True)(_ragged_batch())
    assert rects[0].document_ids_BT is None and rects[0].input_ids_BT.shape[0] == len(_ragged_batch())
    assert padding_mask_BT is not None  # the plain rectangle a MoE load-balancing loss needs


def _document_ids_BT() -> torch.Tensor:
    """Two rows of 300 tokens (three blocks of flex's 128), documents crossing block edges."""
    lengths = [[1, 130, 40, 129], [300]]
    return torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths])


def test_document_mask_mod_is_the_dense_mask():
    from torch.nn.attention.flex_attention import create_mask

    doc_BT = _document_ids_BT()
    dense_B1TT = document_causal_mask(doc_BT)
    width = doc_BT.shape[1]
    assert torch.equal(create_mask(document_causal_mask_mod(doc_BT), 2, 1, width, width, device="cpu"), dense_B1TT)
    assert torch.equal(create_mask(dense_mask_mod(dense_B1TT), 2, 1, width, width, device="cpu"), dense_B1TT)
    # spot checks of the rule: causal within a document, nothing across documents
    assert dense_B1TT[0, 0, 5, 1] and not dense_B1TT[0, 0, 1, 5] and not dense_B1TT[0, 0, 131, 130]
    assert dense_B1TT[1, 0, 299, 0]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_block_mask_attention_equals_dense_mask_sdpa():
    """What CUDA runs (flex_attention with the BlockMask; here its eager CPU implementation,
    forward only, since CPU has no flex backward) equals sdpa with the dense mask."""
    from torch.nn.attention.flex_attention import flex_attention

    doc_BT = _document_ids_BT()
    width = doc_BT.shape[1]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, width, 16, generator=gen) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(doc_BT))
    for mask_mod in (document_causal_mask_mod(doc_BT), dense_mask_mod(document_causal_mask(doc_BT))):
        got = flex_attention(q, k, v, block_mask=block_mask(mask_mod, 2, width, CPU))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_model_attention_mask_per_implementation(tmp_path):
    from torch.nn.attention.flex_attention import BlockMask

    lm = _lm("qwen2", tmp_path)
    assert not use_flex_attention(lm, CPU)  # CPU: sdpa and the dense mask
    assert lm._supports_flex_attn  # the CUDA branch's model switch is accepted for our architectures
    free = padding_free_rectangle(_ragged_batch())
    assert torch.equal(model_attention_mask(free, flex=False), document_causal_mask(free.document_ids_BT))
    assert isinstance(model_attention_mask(free, flex=True), BlockMask)
    shared = SequenceBatch.from_lists([[5, 6, 7]] * 2, [[20, 21], [22]])
    (packed,), _ = packed_rectangles(shared, shared_prompt_groups(shared, PackingCost.from_config(lm.config)), PAD, None)
    assert model_attention_mask(packed, flex=False) is packed.attention_mask_B1TT
    assert isinstance(model_attention_mask(packed, flex=True), BlockMask)
    lm.set_attn_implementation("flex_attention")
    assert lm.config._attn_implementation == "flex_attention"


def test_flex_model_scores_equal_sdpa_scores(tmp_path):
    """The CUDA branch end to end through the model, forward only (CPU flex_attention has no
    backward): a Qwen2 model switched to the engine's flex_attention (transformers' compiled flex call, GQA,
    restarting position ids) and handed BlockMasks scores a padding-free row and shared-prompt rows
    exactly as sdpa with the dense masks does."""
    lm = _lm("qwen2", tmp_path)
    sdpa = CompletionScorer(lm)
    flex = CompletionScorer(lm, flex_attention=True)
    ragged = _ragged_batch()
    shared = SequenceBatch.from_lists([[5, 6, 7]] * 3 + [[8, 9]] * 2, [[20, 21], [22], [23, 24, 25], [26], [27, 28]])
    want = {}
    with torch.no_grad():
        for name, batch in (("padding-free", ragged), ("shared", shared)):
            rects, order_N, _ = _layout(lm, padding_free=True)(batch)
            _, _, targets_N = completion_positions(batch)
            want[name] = (rects, order_N, targets_N, sdpa(rects, targets_N, order_N=order_N)[0])
        switch_to_flex_attention(lm)  # what the engine does on CUDA
        for name, (rects, order_N, targets_N, sdpa_N) in want.items():
            # static shapes per case: inductor's CPU flex template fails to build for a dynamic
            # sequence length (a CPU codegen gap; CUDA has its own template)
            torch._dynamo.reset()
            flex_N = flex(rects, targets_N, order_N=order_N)[0]
            torch.testing.assert_close(flex_N, sdpa_N, rtol=0, atol=1e-5, msg=name)


def test_the_compiled_block_mask_builder_cuda_uses_equals_the_eager_one():
    """CUDA builds BlockMasks with `torch.compile(create_block_mask)`; run here on CPU (inductor)
    for two lengths (the second compiles with a dynamic length), it gives the eager masks."""
    from torch.nn.attention.flex_attention import create_block_mask

    from rltrain.backends.fsdp.micro_batches.attention_masks import compiled_create_block_mask

    for lengths in ([1, 130, 40, 129], [5, 300]):
        doc_BT = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
        width = doc_BT.shape[1]
        mask_mod = document_causal_mask_mod(doc_BT)
        got = compiled_create_block_mask()(mask_mod, B=1, H=None, Q_LEN=width, KV_LEN=width, device=CPU)
        want = create_block_mask(mask_mod, B=1, H=None, Q_LEN=width, KV_LEN=width, device=CPU)
        assert torch.equal(got.to_dense(), want.to_dense()) and got.shape == (1, 1, width, width)
