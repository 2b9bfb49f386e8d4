"""Log-probabilities and entropy of tokens from vocab-parallel logits, never gathering the vocab.

Only a few scalars per token cross tensor-parallel ranks (all-reduced with an identity backward),
and `chunked_vocab_parallel_logps` never materialises the fp32 logits of a rank's vocabulary slice.
docs/internals/backends.md has the maths and the padded-vocabulary rule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rltrain.backends.chunked_head import (
    accumulate_head_grads,
    chunk_logits,
    compute_dtype_for,
    exceeds_chunk_limit,
    positions_per_chunk,
    target_logps_grad,
)

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

_PAD_LOGIT = -1e30  # exp() underflows to 0 in fp32, and 0 * _PAD_LOGIT stays finite


class _AllReduceSum(torch.autograd.Function):
    """Sum across the group in forward; identity in backward (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
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


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def chunked_vocab_parallel_logps(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group,
    with_entropy: bool = False,
    chunk_elements: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`vocab_parallel_logps(hidden_NH @ weight_VH.T, ...)` without its logits (module docstring).
    `weight_VH` is this rank's vocab slice (ids [vocab_start, vocab_start + V)); the matmul runs in
    autocast's dtype where autocast is on, everything after it in fp32."""
    chunk = positions_per_chunk(weight_VH.shape[0], chunk_elements)
    dtype = compute_dtype_for(weight_VH)
    logps_N, entropy_N = _ChunkedVocabParallelLogps.apply(
        hidden_NH, weight_VH, targets_N, vocab_start, vocab_size, group, chunk, dtype
    )
    return logps_N, entropy_N if with_entropy else None


def _masked_chunk_logits(hidden_CH, weight_VH, dtype, vocab_start: int, vocab_size: int) -> torch.Tensor:
    logits_CV = chunk_logits(hidden_CH, weight_VH, dtype)
    if vocab_start + logits_CV.shape[-1] > vocab_size:
        vocab_ids_V = torch.arange(vocab_start, vocab_start + logits_CV.shape[-1], device=logits_CV.device)
        logits_CV = logits_CV.masked_fill(vocab_ids_V >= vocab_size, _PAD_LOGIT)
    return logits_CV


class _ChunkedVocabParallelLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden_NH, weight_VH, targets_N, vocab_start, vocab_size, group, chunk, dtype):
        n, local_vocab = hidden_NH.shape[0], weight_VH.shape[0]
        stats = torch.empty(4, n, dtype=torch.float32, device=hidden_NH.device)  # max, sum exp, target, p*logit
        local_target_N = targets_N - vocab_start
        on_rank_N = (local_target_N >= 0) & (local_target_N < local_vocab)
        with torch.autocast(hidden_NH.device.type, enabled=False):
            for start in range(0, n, chunk):
                end = min(n, start + chunk)
                logits_CV = _masked_chunk_logits(hidden_NH[start:end], weight_VH, dtype, vocab_start, vocab_size)
                max_C = logits_CV.max(dim=-1).values
                shifted_CV = logits_CV - max_C[:, None]
                exp_CV = shifted_CV.exp()
                picked_C = logits_CV.gather(-1, local_target_N[start:end].clamp(0, local_vocab - 1)[:, None]).squeeze(-1)
                stats[0, start:end] = max_C
                stats[1, start:end] = exp_CV.sum(-1)
                stats[2, start:end] = torch.where(on_rank_N[start:end], picked_C, torch.zeros_like(picked_C))
                stats[3, start:end] = (exp_CV * shifted_CV).sum(-1)
        max_N = _all_reduce(stats[0].clone(), group, dist.ReduceOp.MAX)
        scale_N = (stats[0] - max_N).exp()  # this rank's sums, rescaled to the global max
        sums = _all_reduce(torch.stack([stats[1] * scale_N, stats[2], scale_N * (stats[3] + (stats[0] - max_N) * stats[1])]), group)
        sum_exp_N, target_logit_N, expected_shifted_N = sums
        log_z_N = sum_exp_N.log()
        lse_N = max_N + log_z_N
        logps_N = target_logit_N - lse_N
        entropy_N = log_z_N - expected_shifted_N / sum_exp_N
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, lse_N)
        ctx.vocab_start, ctx.vocab_size, ctx.group, ctx.chunk, ctx.dtype = vocab_start, vocab_size, group, chunk, dtype
        ctx.mark_non_differentiable(entropy_N)
        return logps_N, entropy_N

    @staticmethod
    def backward(ctx: Any, grad_N, _grad_entropy_N):
        hidden_NH, weight_VH, targets_N, lse_N = ctx.saved_tensors
        local_vocab = weight_VH.shape[0]
        local_target_N = targets_N - ctx.vocab_start
        on_rank_N = (local_target_N >= 0) & (local_target_N < local_vocab)
        grad_hidden_NH = torch.zeros_like(hidden_NH) if ctx.needs_input_grad[0] else None
        grad_weight_VH = (
            torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device) if ctx.needs_input_grad[1] else None
        )
        with torch.autocast(hidden_NH.device.type, enabled=False):
            for start in range(0, hidden_NH.shape[0], ctx.chunk):
                end = min(hidden_NH.shape[0], start + ctx.chunk)
                hidden_CH = hidden_NH[start:end]
                logits_CV = _masked_chunk_logits(hidden_CH, weight_VH, ctx.dtype, ctx.vocab_start, ctx.vocab_size)
                grad_logits_CV = target_logps_grad(  # the one-hot only where the target is this rank's
                    logits_CV, lse_N[start:end], local_target_N[start:end].clamp(0, local_vocab - 1),
                    on_rank_N[start:end].to(torch.float32), grad_N[start:end],
                )
                grad_hidden_CH = grad_hidden_NH[start:end] if grad_hidden_NH is not None else None
                accumulate_head_grads(grad_logits_CV, hidden_CH, weight_VH, ctx.dtype, grad_hidden_CH, grad_weight_VH)
        if grad_hidden_NH is not None:  # every rank's columns contribute to the hidden states' gradient
            _all_reduce(grad_hidden_NH, ctx.group)
        if grad_weight_VH is not None:
            grad_weight_VH = grad_weight_VH.to(weight_VH.dtype)
        return grad_hidden_NH, grad_weight_VH, None, None, None, None, None, None


def head_logps(
    model: GPTModel,
    hidden_NH: torch.Tensor,
    targets_N: torch.Tensor,
    tp_rank: int,
    vocab_size: int,
    group,
    with_entropy: bool,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (and entropy) of `targets_N` from a last stage's final hidden states at
    the positions that predict them (`hidden_out`): megatron's vocab-parallel output layer on those
    positions, or, when `[N, V/tp]` logits would exceed the FSDP head's chunk limit
    (`rltrain.backends.chunked_head`), `chunked_vocab_parallel_logps`. The matmul runs under
    `autocast` (bf16-mixed: bf16, as megatron's own head would), the rest in fp32."""
    tied = model.share_embeddings_and_output_weights
    weight_VH = model.shared_embedding_or_output_weight() if tied else model.output_layer.weight
    vocab_start = tp_rank * weight_VH.shape[0]
    with autocast():
        if exceeds_chunk_limit(hidden_NH.shape[0], weight_VH.shape[0]):
            return chunked_vocab_parallel_logps(
                hidden_NH, weight_VH, targets_N, vocab_start, vocab_size, group, with_entropy
            )
        logits_N1V, _ = model.output_layer(hidden_NH.unsqueeze(1), weight=weight_VH if tied else None)
    return vocab_parallel_logps(logits_N1V.squeeze(1), targets_N, vocab_start, vocab_size, group, with_entropy)
