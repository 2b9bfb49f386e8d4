"""The chunked output head gives the plain head's numbers: log-probabilities, entropies and the
gradients of the hidden states and of the head weight (fp32, 1e-6), for any chunk size, and
through a real model's scorer."""

from __future__ import annotations

import pytest
import torch

from rltrain.backends import chunked_head
from rltrain.backends.chunked_head import chunked_target_logps, use_chunked_head


def _plain(hidden_NH, weight_VH, targets_N):
    logp_NV = torch.log_softmax((hidden_NH @ weight_VH.t()).float(), dim=-1)
    entropy_N = -(logp_NV.exp() * logp_NV).sum(-1)
    return logp_NV.gather(-1, targets_N[:, None]).squeeze(-1), entropy_N.detach()


@pytest.mark.parametrize("chunk_positions", [1, 3, 7, 50])
def test_chunked_equals_plain_in_values_and_gradients(chunk_positions):
    torch.manual_seed(0)
    n, h, v = 23, 16, 37
    # Scaled like a trained model's (logits of order 1), so that 1e-6 is fp32 round-off.
    hidden = (0.5 * torch.randn(n, h, dtype=torch.float32)).requires_grad_()
    weight = (0.5 * torch.randn(v, h, dtype=torch.float32)).requires_grad_()
    targets = torch.randint(0, v, (n,))
    upstream = torch.randn(n)

    ref_logps, ref_entropy = _plain(hidden, weight, targets)
    (ref_logps * upstream).sum().backward()
    ref_gh, ref_gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    logps, entropy = chunked_target_logps(hidden, weight, targets, with_entropy=True, chunk_elements=chunk_positions * v)
    (logps * upstream).sum().backward()
    torch.testing.assert_close(logps, ref_logps, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad, ref_gh, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_gw, rtol=1e-6, atol=1e-6)


def test_only_large_bias_free_heads_are_chunked():
    head = torch.nn.Linear(8, 100, bias=False)
    assert not use_chunked_head(10, head, chunk_elements=1000)
    assert use_chunked_head(11, head, chunk_elements=1000)
    assert not use_chunked_head(11, torch.nn.Linear(8, 100, bias=True), chunk_elements=1000)


def test_scorer_with_the_chunked_head_matches_the_plain_scorer(tiny_cache, monkeypatch):
    """A real tiny Qwen2 through CompletionScorer: the same log-probs, entropies and parameter
    gradients whether its head is chunked (threshold forced down) or not."""
    from transformers import AutoModelForCausalLM

    from rltrain.backends.fsdp.hf_scoring import CompletionScorer, completion_positions
    from rltrain.backends.fsdp.micro_batches.shared_prefix import Rectangle
    from rltrain.config.schema import ModelConfig
    from rltrain.data.batch import SequenceBatch
    from rltrain.models.tiny import build_tiny_model_dir

    model_dir = build_tiny_model_dir(ModelConfig(), seed=0)
    batch = SequenceBatch.from_lists([[5, 6, 7], [8, 9]], [[10, 11, 12, 13], [14, 15]])
    ids, _ = batch.tokens.to_padded(0)
    rows, cols, targets = completion_positions(batch)

    def run(threshold: int):
        monkeypatch.setattr(chunked_head, "CHUNK_ELEMENTS", threshold)
        torch.manual_seed(0)
        lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        scorer = CompletionScorer(lm).train()
        logps, entropy, _ = scorer([Rectangle(ids, rows, cols)], targets, True)
        logps.sum().backward()
        return logps.detach(), entropy, {n: p.grad.clone() for n, p in scorer.named_parameters() if p.grad is not None}

    vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
    plain = run(1 << 40)
    chunked = run(2 * vocab)  # two positions per chunk
    torch.testing.assert_close(chunked[0], plain[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chunked[1], plain[1], rtol=1e-6, atol=1e-6)
    assert chunked[2].keys() == plain[2].keys()
    # Gradients: the head weight's (the tied embedding's) is summed chunk by chunk, a different order
    # of fp32 additions that reaches every parameter; compared as a whole, relative to its norm
    # (with a 1e-7 floor for parameters whose gradient is itself tiny, like the k biases).
    for name, ref in plain[2].items():
        assert (chunked[2][name] - ref).norm() <= 1e-6 * ref.norm() + 1e-7, name
