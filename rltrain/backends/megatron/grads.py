"""Gradient reduction and clipping for sharded megatron parameters.

Gradients are summed over data parallel and tied-embedding copies (a MoE's experts over the
expert-data-parallel ranks that hold the same experts), the global norm counts each parameter once
across tp x pp (an expert once across ep x pp), and one finite verdict decides whether every rank steps.
docs/internals/backends.md lists the rules.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from rltrain.backends.megatron.convert import split_dim
from rltrain.runtime.distributed import control_device


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def fill_missing_grads(params: list[torch.nn.Parameter]) -> None:
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def sum_over_data_parallel(params: list[torch.nn.Parameter], dp_group) -> None:
    if _group_size(dp_group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        assert p.grad is not None  # every trained parameter has a gradient after the backward
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=dp_group)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)


def sum_tensor_parallel_partials(partials: list[torch.nn.Parameter], tp_group) -> None:
    """Sum over the TP ranks the gradients of replicated weights each rank applies to its own heads
    only (Qwen3's q/k norms, `convert.partial_under_tp`), as megatron's finalize_model_grads does."""
    if _group_size(tp_group) == 1:
        return
    sum_over_data_parallel(partials, tp_group)


def sum_expert_grads(experts: list[torch.nn.Parameter], expert_dp_group, tp: int) -> None:
    """Sum a MoE's expert gradients over the replicas that hold the same experts. Under tensor
    parallelism every TP rank routed its own copy of each token, so each expert's sum holds tp
    copies of its true gradient: divided by tp (model._moe_layers_accept_tensor_parallel_input)."""
    sum_over_data_parallel(experts, expert_dp_group)
    if tp > 1:
        for p in experts:
            assert p.grad is not None
            p.grad.div_(tp)


def sync_tied_embedding(shared_weight: torch.nn.Parameter | None, embd_group) -> None:
    """Sum the gradients of the tied embedding's two copies (first and last pipeline stage)."""
    if shared_weight is None or _group_size(embd_group) == 1:
        return
    dist.all_reduce(shared_weight.grad, group=embd_group)


def norm_counted(name: str, tp_rank: int, tied_copy: bool) -> bool:
    """Whether a parameter's gradient enters the global norm on this rank (see module docstring).

    Decided from the conversion table, not from megatron's `tensor_model_parallel` attribute:
    megatron sets that attribute only when it initialises the weight itself.
    """
    if tied_copy:
        return False
    return tp_rank == 0 or split_dim(name) is not None


def _squared_sum(counted: list[torch.nn.Parameter], group) -> torch.Tensor:
    sq = torch.zeros(1, dtype=torch.float64, device=counted[0].device if counted else "cpu")
    for p in counted:
        assert p.grad is not None
        sq += p.grad.detach().double().pow(2).sum()
    if _group_size(group) > 1:
        dist.all_reduce(sq, group=group)
    return sq


def global_grad_norm(
    counted: list[torch.nn.Parameter],
    mp_group,
    experts: list[torch.nn.Parameter] | None = None,
    expert_mp_group=None,
) -> torch.Tensor:
    """L2 norm of the full model's gradient from the parameters this rank counts; equal on every
    rank of the model-parallel group. A MoE's `experts` (this rank's) are summed over the ranks
    that hold the other experts (`expert_mp_group`) instead."""
    sq = _squared_sum(counted, mp_group)
    if experts is not None:
        sq = sq + _squared_sum(experts, expert_mp_group).to(sq.device)
    return sq.sqrt().float()


def all_finite(value: float) -> bool:
    """Whether `value` is finite on every rank (MIN over the world group)."""
    flag = torch.tensor([1 if math.isfinite(value) else 0], dtype=torch.int32, device=control_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(int(flag))


def clip_(params: list[torch.nn.Parameter], total_norm: float, max_norm: float) -> None:
    """Scale grads so the global norm is at most `max_norm` (torch's clip_grad_norm_ rule)."""
    if max_norm <= 0:
        return
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        for p in params:
            assert p.grad is not None
            p.grad.mul_(coef)
