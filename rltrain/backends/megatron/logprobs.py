"""Log-probabilities and entropy of tokens from vocab-parallel logits, never gathering the vocab.

Each tensor-parallel rank holds the logits of a contiguous slice of the vocabulary. The
log-softmax needs only three scalars per token from across ranks: the max (for stability, no
gradient), the sum of exponentials, and the target's logit (which lives on exactly one rank);
entropy needs one more, the sum of p * logit. Each is all-reduced with an identity backward:
every TP rank computes the same loss from the same replicated sums, and the gradient of that loss
with respect to a rank's local partial sum is exactly the gradient with respect to the full sum,
so no TP rank double-counts (megatron's `reduce_from_tensor_model_parallel_region` convention).

Padded vocabulary rows (added so the vocab splits evenly over tp) get a large negative logit:
probability exactly 0, so they change neither the normaliser nor the entropy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_PAD_LOGIT = -1e30  # exp() underflows to 0 in fp32, and 0 * _PAD_LOGIT stays finite


class _AllReduceSum(torch.autograd.Function):
    """Sum across the group in forward; identity in backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)


def vocab_parallel_logps(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) [N] and optionally entropy [N] from this rank's vocab slice of the logits.

    `logits_NV` are the logits of vocab ids [vocab_start, vocab_start + V) on this rank; ids at or
    beyond `vocab_size` are padding. Computed in fp32 whatever the logits' dtype. The
    log-probabilities are differentiable; the entropy is a metric and carries no graph.
    """
    logits_NV = logits_NV.float()
    local_vocab = logits_NV.shape[-1]
    vocab_ids_V = torch.arange(vocab_start, vocab_start + local_vocab, device=logits_NV.device)
    if vocab_start + local_vocab > vocab_size:
        logits_NV = logits_NV.masked_fill(vocab_ids_V >= vocab_size, _PAD_LOGIT)

    max_N = logits_NV.detach().max(dim=-1).values
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(max_N, op=dist.ReduceOp.MAX, group=group)
    shifted_NV = logits_NV - max_N.unsqueeze(-1)
    sum_exp_N = _reduce_sum(shifted_NV.exp().sum(dim=-1), group)
    log_z_N = sum_exp_N.log()

    local_target_N = targets_N - vocab_start
    on_rank_N = (local_target_N >= 0) & (local_target_N < local_vocab)
    picked_N = shifted_NV.gather(-1, local_target_N.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    target_logit_N = _reduce_sum(torch.where(on_rank_N, picked_N, torch.zeros_like(picked_N)), group)
    logps_N = target_logit_N - log_z_N

    entropy_N = None
    if with_entropy:
        with torch.no_grad():
            probs_NV = (shifted_NV - log_z_N.unsqueeze(-1)).exp()
            expected_logit_N = _reduce_sum((probs_NV * shifted_NV).sum(dim=-1), group)
            entropy_N = log_z_N - expected_logit_N
    return logps_N, entropy_N
