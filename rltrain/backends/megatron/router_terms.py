"""A MoE's router losses and load on the megatron backend, with the FSDP engine's meanings.

megatron-core's own router losses are another loss than the one `model.moe.aux_loss_coef` weighs
under FSDP2 (per layer and divided by top-k where transformers pools the layers, padding
included, each micro-batch's term backwarded at full weight), so the engine computes the terms
itself: each training forward keeps every MoE layer's router logits (its `gating` output, fp32),
and the last stage turns them into `rltrain.models.moe.router_terms_with` (the family's own
load-balancing function, the z-loss, the load imbalance) over the micro-batch's real tokens,
added to the loss with the FSDP weights. docs/moe.md, "Router losses and metrics".
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rltrain.backends.base import LossMetrics
from rltrain.backends.megatron.batching import PaddedMicroBatch
from rltrain.backends.megatron.groups import ParallelCoords
from rltrain.backends.megatron.spec import ModelSpec
from rltrain.models import moe
from rltrain.runtime.distributed import control_device
from rltrain.runtime.errors import UserError

ROUTER_LOSSES_UNDER_PP = (
    "model.moe.aux_loss_coef / model.moe.z_loss_coef with backend=megatron backend.pp > 1: the router losses mean "
    "what they mean under FSDP2 (the family's load-balancing loss pools every layer's routing; docs/moe.md), which "
    "needs every MoE layer on one pipeline stage, so they are not run across stages. Set backend.pp=1 (use "
    "backend.tp, backend.ep or data parallelism instead), or set both coefficients to 0 (aux_loss_coef=0 also "
    "overrides a checkpoint that asks for its own)."
)


def router_capture(
    model: torch.nn.Module, spec: ModelSpec, losses: moe.RouterLosses | None, model_dir: Path, pp: int
) -> RouterCapture | None:
    """A MoE stage's router terms (None for a dense model); a router loss needs pp == 1."""
    if spec.moe is None:
        return None
    from transformers import AutoConfig

    capture = RouterCapture(model, spec, losses or moe.RouterLosses(), AutoConfig.from_pretrained(model_dir))
    if capture.losses_on and pp > 1:
        raise UserError(ROUTER_LOSSES_UNDER_PP)
    return capture


class RouterCapture:
    """Each training forward's router logits of this stage's MoE layers, turned into that
    micro-batch's router terms (`terms[i]`) right after the stage's forward.

    Only forwards with gradients count (scoring passes have no loss); a layer recomputed in the
    backward (activation checkpointing) overwrites its logits, which the next forward replaces
    before they are read. Under a pipeline each stage holds its own layers' terms; the losses
    need every layer on one stage (`pp` > 1 with a router loss is refused in preflight), the load
    imbalance is a maximum over stages (`step_load_imbalance`)."""

    def __init__(self, model: torch.nn.Module, spec: ModelSpec, losses: moe.RouterLosses, hf_config: Any) -> None:
        from megatron.core.transformer.moe.router import Router

        assert spec.moe is not None
        self.info = moe.MoEInfo(
            spec.moe.num_experts, spec.moe.topk, moe.aux_loss_coef(hf_config, losses), "megatron",
            float(losses.z_loss_coef),
        )
        modeling = importlib.import_module(f"transformers.models.{hf_config.model_type}.modeling_{hf_config.model_type}")
        self._balance_fn = modeling.load_balancing_loss_func
        self._latest: dict[int, torch.Tensor] = {}
        self._masks: list[torch.Tensor] = []
        self.terms: list[moe.RouterTerms] = []
        for index, router in enumerate(m for m in model.modules() if isinstance(m, Router)):
            router.gating = self._keeping(router.gating, index)
        model.register_forward_hook(self._after_forward)

    @property
    def losses_on(self) -> bool:
        return self.info.aux_loss_coef > 0 or self.info.z_loss_coef > 0

    def _keeping(self, gating, index: int):
        def gating_kept(input: torch.Tensor) -> torch.Tensor:
            logits = gating(input)
            if self._masks and torch.is_grad_enabled():
                self._latest[index] = logits
            return logits

        return gating_kept

    def begin(self, padded: list[PaddedMicroBatch]) -> None:
        """A train step over `padded` starts: its forwards run in this order on every stage."""
        self._masks = [mb.real_BT for mb in padded]
        self.terms = []
        self._latest.clear()

    def end(self) -> None:
        self._masks = []
        self._latest.clear()

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._masks or not torch.is_grad_enabled() or len(self.terms) >= len(self._masks):
            return
        mask_BT = self._masks[len(self.terms)]
        # each [T, B, E] (megatron's sequence first) as [T x B, E]
        logits = tuple(self._latest[i].reshape(-1, self.info.num_experts) for i in sorted(self._latest))
        self._latest.clear()
        # the terms pair each token with its mask entry and are otherwise order-free: the mask goes
        # sequence first (where transformers' is batch first), the logits stay as they are
        mask_TB = mask_BT.T.contiguous().to(logits[0].device)
        self.terms.append(moe.router_terms_with(self._balance, self.info, logits, mask_TB))

    def _balance(self, info: moe.MoEInfo, logits: tuple[torch.Tensor, ...], mask_BT: torch.Tensor) -> torch.Tensor:
        return moe.family_balance_loss(self._balance_fn, info, logits, mask_BT)

    def with_losses(self, i: int, mb: PaddedMicroBatch, loss: torch.Tensor, metrics: LossMetrics, share: float):
        """Micro-batch `i`'s loss plus its weighted aux and z losses, and those in its metrics
        (each a per-micro-batch mean scaled by `share`, as in the FSDP engine; a dummy's weight 0)."""
        terms = self.terms[i]
        weight = 0.0 if mb.is_dummy else share
        if terms.aux_loss is not None:
            loss = loss + self.info.aux_loss_coef * weight * terms.aux_loss
            metrics = {**metrics, "moe/aux_loss": terms.aux_loss.detach() * weight}
        if terms.z_loss is not None:
            loss = loss + self.info.z_loss_coef * weight * terms.z_loss
            metrics = {**metrics, "moe/z_loss": terms.z_loss.detach() * weight}
        return loss, metrics

    def step_load_imbalance(self, padded: list[PaddedMicroBatch], coords: ParallelCoords, share: float) -> float:
        """`moe/load_imbalance`'s contribution of this rank's micro-batches: each one's largest
        over every layer (a maximum over the pipeline's stages) times `share`. Collective over
        the pipeline group."""
        values = torch.stack([t.load_imbalance.float() for t in self.terms]) if self.terms else torch.zeros(0)
        if coords.pp > 1:
            values = values.to(control_device())
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=coords.pp_group)
        weights = torch.tensor([0.0 if mb.is_dummy else share for mb in padded], dtype=torch.float64)
        return float((values.double().cpu() * weights).sum())
