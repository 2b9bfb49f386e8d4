"""Target-token log-probabilities through the output head, one chunk of positions at a time.

Full fp32 logits, their log-softmax and their gradient are each `[N, V]`, gigabytes for a real
vocabulary; this never holds more than one chunk, recomputing it in the backward, with the plain
path's numbers. docs/internals/backends.md says when it applies and how the backward works.
"""

from __future__ import annotations

from typing import Any

import torch

# Elements of fp32 logits one chunk may hold (512 MiB); also the threshold for chunking at all.
CHUNK_ELEMENTS = 1 << 27


def exceeds_chunk_limit(num_positions: int, vocab_rows: int, chunk_elements: int | None = None) -> bool:
    """Whether `[num_positions, vocab_rows]` fp32 logits would exceed one chunk, i.e. whether to
    chunk at all (FSDP's head here; megatron's vocab-parallel head, per tensor-parallel rank)."""
    return num_positions * vocab_rows > (CHUNK_ELEMENTS if chunk_elements is None else chunk_elements)


def positions_per_chunk(vocab_rows: int, chunk_elements: int | None = None) -> int:
    return max(1, (CHUNK_ELEMENTS if chunk_elements is None else chunk_elements) // vocab_rows)


def use_chunked_head(num_positions: int, head: torch.nn.Module, chunk_elements: int | None = None) -> bool:
    return head.bias is None and exceeds_chunk_limit(num_positions, head.weight.shape[0], chunk_elements)


def compute_dtype_for(weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's where it is on, else the weight's."""
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def chunked_target_logps(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    with_entropy: bool = False,
    chunk_elements: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target) per position in fp32, differentiable; entropy per position in fp32, detached,
    or None)."""
    dtype = compute_dtype_for(weight_VH)
    chunk = positions_per_chunk(weight_VH.shape[0], chunk_elements)
    entropy_N = torch.empty(hidden_NH.shape[0], dtype=torch.float32, device=hidden_NH.device) if with_entropy else None
    logps_N = _ChunkedTargetLogps.apply(hidden_NH, weight_VH, targets_N, chunk, dtype, entropy_N)
    return logps_N, entropy_N


def chunk_logits(hidden_CH: torch.Tensor, weight_VH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (hidden_CH.to(dtype) @ weight_VH.to(dtype).t()).float()


def target_logps_grad(
    logits_CV: torch.Tensor, lse_C: torch.Tensor, target_C: torch.Tensor, onehot_C: torch.Tensor, grad_C: torch.Tensor
) -> torch.Tensor:
    """d (g * log p(target)) / d logits = g * (onehot(target) - softmax), in fp32, for one chunk.
    `onehot_C` is 1 where the target's column is among these logits (a vocab-parallel rank holds
    only some) and 0 elsewhere; `target_C` must index a column either way."""
    grad_CV = -(logits_CV - lse_C[:, None]).exp_()
    grad_CV.scatter_add_(-1, target_C[:, None], onehot_C[:, None])
    return grad_CV.mul_(grad_C[:, None].float())


def accumulate_head_grads(
    grad_logits_CV: torch.Tensor,
    hidden_CH: torch.Tensor,
    weight_VH: torch.Tensor,
    dtype: torch.dtype,
    grad_hidden_CH: torch.Tensor | None,
    grad_weight_VH: torch.Tensor | None,
) -> None:
    """The head's backward for one chunk, both matmuls in the compute dtype: the hidden states'
    gradient written into `grad_hidden_CH` (a view of the whole), the weight's added to the fp32
    `grad_weight_VH`; None skips either."""
    grad_logits_CV = grad_logits_CV.to(dtype)
    if grad_hidden_CH is not None:
        grad_hidden_CH.copy_((grad_logits_CV @ weight_VH.to(dtype)).to(grad_hidden_CH.dtype))
    if grad_weight_VH is not None:
        grad_weight_VH += (grad_logits_CV.t() @ hidden_CH.to(dtype)).float()


class _ChunkedTargetLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden_NH, weight_VH, targets_N, chunk, dtype, entropy_out_N):
        with torch.autocast(hidden_NH.device.type, enabled=False):
            n = hidden_NH.shape[0]
            logps_N = torch.empty(n, dtype=torch.float32, device=hidden_NH.device)
            lse_N = torch.empty(n, dtype=torch.float32, device=hidden_NH.device)
            for start in range(0, n, chunk):
                end = min(n, start + chunk)
                logits_CV = chunk_logits(hidden_NH[start:end], weight_VH, dtype)
                lse_C = torch.logsumexp(logits_CV, dim=-1)
                lse_N[start:end] = lse_C
                logps_N[start:end] = logits_CV.gather(-1, targets_N[start:end, None]).squeeze(-1) - lse_C
                if entropy_out_N is not None:
                    logp_CV = logits_CV - lse_C[:, None]
                    entropy_out_N[start:end] = -(logp_CV.exp() * logp_CV).sum(-1)
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, lse_N)
        ctx.chunk, ctx.dtype = chunk, dtype
        return logps_N

    @staticmethod
    def backward(ctx: Any, grad_N):
        hidden_NH, weight_VH, targets_N, lse_N = ctx.saved_tensors
        grad_hidden_NH = torch.zeros_like(hidden_NH) if ctx.needs_input_grad[0] else None
        grad_weight_VH = torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device) if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden_NH.device.type, enabled=False):
            for start in range(0, hidden_NH.shape[0], ctx.chunk):
                end = min(hidden_NH.shape[0], start + ctx.chunk)
                hidden_CH = hidden_NH[start:end]
                logits_CV = chunk_logits(hidden_CH, weight_VH, ctx.dtype)
                lse_C = lse_N[start:end]
                grad_logits_CV = target_logps_grad(logits_CV, lse_C, targets_N[start:end], torch.ones_like(lse_C), grad_N[start:end])
                grad_hidden_CH = grad_hidden_NH[start:end] if grad_hidden_NH is not None else None
                accumulate_head_grads(grad_logits_CV, hidden_CH, weight_VH, ctx.dtype, grad_hidden_CH, grad_weight_VH)
        if grad_weight_VH is not None:
            grad_weight_VH = grad_weight_VH.to(weight_VH.dtype)
        return grad_hidden_NH, grad_weight_VH, None, None, None, None
