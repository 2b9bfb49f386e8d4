"""Megatron's chunked vocab-parallel head equals the unchunked vocab-parallel path (fp32, 1e-6):
log-probabilities, entropies, and the gradients of the hidden states and of this rank's slice of
the output weight, on 1 rank and on 2 tensor-parallel ranks (gloo), with a padded vocabulary row
and several chunk sizes; both also equal a plain full-vocabulary log-softmax."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks

pytestmark = pytest.mark.dist

N, H, VOCAB = 23, 16, 37  # 37 ids padded to 38 rows: split 19 + 19 over two ranks


def _compare(rank: int, world: int) -> int:
    from rltrain.backends.megatron.logprobs import chunked_vocab_parallel_logps, vocab_parallel_logps

    g = torch.Generator().manual_seed(0)
    # Scaled like a trained model's (logits of order 1), so that 1e-6 is fp32 round-off.
    hidden_full = 0.5 * torch.randn(N, H, generator=g)
    weight_full = torch.cat([0.5 * torch.randn(VOCAB, H, generator=g), torch.zeros(1, H)])  # + one padding row
    targets = torch.randint(0, VOCAB, (N,), generator=g)
    upstream = torch.randn(N, generator=g)
    rows = weight_full.shape[0] // world
    start = rank * rows
    group = dist.group.WORLD if world > 1 else None

    # The unchunked path: this rank's logits from its weight slice; the hidden states' gradient
    # summed over ranks, as megatron's column-parallel output layer does.
    hidden = hidden_full.clone().requires_grad_()
    weight = weight_full[start:start + rows].clone().requires_grad_()
    ref_logps, ref_entropy = vocab_parallel_logps(hidden @ weight.t(), targets, start, VOCAB, group, with_entropy=True)
    (ref_logps * upstream).sum().backward()
    ref_gh, ref_gw = hidden.grad.clone(), weight.grad.clone()
    if group is not None:
        dist.all_reduce(ref_gh, group=group)

    full_logp = torch.log_softmax(hidden_full @ weight_full[:VOCAB].t(), dim=-1)
    torch.testing.assert_close(ref_logps.detach(), full_logp.gather(-1, targets[:, None]).squeeze(-1), rtol=1e-6, atol=1e-6)

    for chunk_positions in (1, 4, 7, 50):
        hidden.grad = weight.grad = None
        logps, entropy = chunked_vocab_parallel_logps(
            hidden, weight, targets, start, VOCAB, group, with_entropy=True, chunk_elements=chunk_positions * rows
        )
        (logps * upstream).sum().backward()
        torch.testing.assert_close(logps.detach(), ref_logps.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(entropy, ref_entropy, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(hidden.grad, ref_gh, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(weight.grad, ref_gw, rtol=1e-6, atol=1e-6)
        assert entropy.grad_fn is None
    return rank


@pytest.mark.parametrize("tp", [1, 2])
def test_chunked_vocab_parallel_logps_equal_the_unchunked_path(tp):
    assert run_ranks(_compare, nproc=tp, timeout_s=120) == list(range(tp))
