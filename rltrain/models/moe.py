"""Mixture-of-Experts models under FSDP2: the same graph on every rank, whatever the routing.

transformers' `eager` experts loop only over the experts that received tokens, so the autograd
graph differs per rank; `every_expert_forward` runs every expert every step instead. Router logits
are requested only from a real MoE model that asks for them. docs/internals/models.md has details.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import PreTrainedModel

EVERY_EXPERT = "rltrain_every_expert"


def num_experts(config: Any) -> int:
    """Experts per MoE layer (0 for a dense model); config key names differ between families."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 1:
            return value
    return 0


def is_moe(config: Any) -> bool:
    return num_experts(config) > 1


def checkpoint_weights(
    model: PreTrainedModel, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A MoE model's named tensors under its checkpoint's names and layout, one tensor at a time.

    transformers 5 fuses each layer's experts into 3-D parameters on load (`experts.gate_up_proj`
    [E, 2I, H]); checkpoints, vLLM and the megatron converter name every expert's matrices
    (`experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1.weight`). The
    family's own reverse conversion (what `save_pretrained` applies) splits each fused tensor alone."""
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in weights:
        for checkpoint_name, part in revert_weight_conversion(model, {name: tensor}).items():
            yield checkpoint_name, part.contiguous()


@dataclass(frozen=True)
class CheckpointPlace:
    """Where a checkpoint tensor lives in the model: its flat element indices in one parameter."""

    name: str
    flat_index: torch.Tensor  # the checkpoint tensor's shape

    def write(self, params: dict[str, torch.Tensor], tensor: torch.Tensor) -> None:
        target = params[self.name]
        target.data.view(-1)[self.flat_index.flatten()] = tensor.flatten().to(target.device, target.dtype)


def checkpoint_places(model: PreTrainedModel) -> dict[str, CheckpointPlace]:
    """For each checkpoint tensor of a MoE model that is not one of the model's own (its experts,
    fused on load), where its elements sit in the model's parameters: the inverse of
    `checkpoint_weights`, found by sending each parameter's element indices through it, so an
    engine that receives checkpoint names writes in place. The indices cost as much memory as
    the fused experts (int32 where they fit)."""
    places: dict[str, CheckpointPlace] = {}
    for name, tensor in model.state_dict().items():
        dtype = torch.int32 if tensor.numel() < 2**31 else torch.int64
        index = torch.arange(tensor.numel(), dtype=dtype).reshape(tensor.shape)
        for checkpoint_name, part in checkpoint_weights(model, [(name, index)]):
            if checkpoint_name != name:
                places[checkpoint_name] = CheckpointPlace(name, part.long() if dtype == torch.int32 else part)
    return places


def load_checkpoint_weights(
    model: PreTrainedModel, weights: dict[str, torch.Tensor]
) -> tuple[list[str], list[str]]:
    """`load_state_dict(weights, strict=False)` for tensors under the checkpoint's names (what
    `export_weights` sends): (missing, unexpected) as it reports them."""
    places = checkpoint_places(model) if is_moe(model.config) else {}
    params = model.state_dict(keep_vars=True)
    placed = {place.name for name, place in places.items() if name in weights}
    for name, place in places.items():
        if name in weights:
            place.write(params, weights[name])
    missing, unexpected = model.load_state_dict({k: v for k, v in weights.items() if k not in places}, strict=False)
    return [m for m in missing if m not in placed], list(unexpected)


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    y = x @ weight if transposed else F.linear(x, weight)
    return y + bias if bias is not None else y


def every_expert_forward(
    self: Any,  # a transformers experts module: its weights and flags vary by model family
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The eager experts loop, over *every* expert: an expert without tokens runs on an empty
    input, so the graph is identical on every rank and in every recompute."""
    transposed = bool(getattr(self, "is_transposed", False))
    has_bias = bool(getattr(self, "has_bias", False))
    has_gate = bool(getattr(self, "has_gate", True))
    final = torch.zeros_like(hidden_states)
    for e in range(self.num_experts):
        token_idx, k_pos = torch.where(top_k_index == e)
        x = hidden_states[token_idx]
        if has_gate:
            up = _project(x, self.gate_up_proj[e], self.gate_up_proj_bias[e] if has_bias else None, transposed)
            h = self._apply_gate(up)
        else:
            h = self.act_fn(_project(x, self.up_proj[e], self.up_proj_bias[e] if has_bias else None, transposed))
        y = _project(h, self.down_proj[e], self.down_proj_bias[e] if has_bias else None, transposed)
        y = y * top_k_weights[token_idx, k_pos, None]
        final = final.index_add(0, token_idx, y.to(final.dtype))
    return final


def _register_every_expert() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if EVERY_EXPERT not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(EVERY_EXPERT, every_expert_forward)


@dataclass(frozen=True)
class RouterLosses:
    """`model.moe.aux_loss_coef` and `model.moe.z_loss_coef` as the run resolves them
    (`router_losses`); None: the checkpoint's own load-balancing setting."""

    aux_loss_coef: float | None = None
    z_loss_coef: float = 0.0


def router_losses(aux_loss_coef: float | None, z_loss_coef: float, generates: bool) -> RouterLosses:
    """The run's router losses: an unset `aux_loss_coef` is the checkpoint's own setting for an
    algorithm trained on data, and off for one that generates its own (RL: peers keep it off,
    docs/moe.md)."""
    if aux_loss_coef is None and generates:
        aux_loss_coef = 0.0
    return RouterLosses(aux_loss_coef, z_loss_coef)


@dataclass
class MoEInfo:
    num_experts: int
    top_k: int
    aux_loss_coef: float  # 0: no load-balancing loss
    implementation: str
    z_loss_coef: float = 0.0  # 0: no router z-loss


@dataclass
class RouterTerms:
    """One training micro-batch's router terms, over its real tokens (docs/moe.md, "Router losses
    and metrics"): the losses where their coefficients ask for them, and the load imbalance."""

    aux_loss: torch.Tensor | None
    z_loss: torch.Tensor | None
    load_imbalance: torch.Tensor  # max over layers of the busiest expert's share x experts


def router_outputs(terms: RouterTerms | None, weight: float = 1.0) -> dict[str, torch.Tensor | None]:
    """`scored_output`'s MoE fields from a scorer's router terms; `weight=0` keeps the graph of a
    dummy micro-batch's losses (every parameter reached) and contributes no value."""
    if terms is None:
        return {"aux_loss": None, "z_loss": None, "load_imbalance": None}
    return {
        "aux_loss": terms.aux_loss * weight if terms.aux_loss is not None else None,
        "z_loss": terms.z_loss * weight if terms.z_loss is not None else None,
        "load_imbalance": terms.load_imbalance * weight,
    }


def prepare_moe(model: PreTrainedModel, losses: RouterLosses | None = None) -> MoEInfo | None:
    """For a MoE causal LM: make the experts routing-independent (see the module docstring) and
    resolve its router losses (`losses`, or the checkpoint's own load-balancing setting). None
    for a dense model."""
    config = model.config
    if not is_moe(config):
        return None
    losses = losses or RouterLosses()
    implementation = getattr(config, "_experts_implementation", None) or "eager"
    if implementation == "eager":
        _register_every_expert()
        model.set_experts_implementation(EVERY_EXPERT)
        implementation = EVERY_EXPERT
    top_k = int(getattr(config, "num_experts_per_tok", 1))
    return MoEInfo(num_experts(config), top_k, aux_loss_coef(config, losses), implementation, float(losses.z_loss_coef))


def aux_loss_coef(config: Any, losses: RouterLosses) -> float:
    """The load-balancing loss's weight: `losses.aux_loss_coef`, or where that is None the
    checkpoint's own (its `router_aux_loss_coef` where its config asks for router logits, as
    transformers trains it), else 0. Both backends resolve it here (docs/moe.md)."""
    if losses.aux_loss_coef is not None:
        return float(losses.aux_loss_coef)
    own = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    return own if bool(getattr(config, "output_router_logits", False)) else 0.0


def router_terms(
    model: torch.nn.Module, info: MoEInfo, router_logits: tuple[torch.Tensor, ...], mask_BT: torch.Tensor | None
) -> RouterTerms:
    """The load-balancing loss (the family's own, Switch Transformer), the router z-loss (ST-MoE:
    the mean over layers and real tokens of logsumexp(router logits)^2) where their coefficients
    are set, and the load imbalance, all in fp32 over real tokens only."""
    return router_terms_with(partial(load_balancing_loss, model), info, router_logits, mask_BT)


def router_terms_with(
    balance_loss: Any, info: MoEInfo, router_logits: tuple[torch.Tensor, ...], mask_BT: torch.Tensor | None
) -> RouterTerms:
    """`router_terms` with the load-balancing loss given as `balance_loss(info, router_logits,
    mask_BT)`: the megatron backend passes the family's function without a Hugging Face model."""
    logits_LNE = torch.stack([r.float() for r in router_logits])  # N = B x T, padding included
    real_N = mask_BT.reshape(-1).bool() if mask_BT is not None else torch.ones(logits_LNE.shape[1], dtype=torch.bool)
    real_N = real_N.to(logits_LNE.device)
    logits_LRE = logits_LNE[:, real_N]
    aux = balance_loss(info, router_logits, mask_BT) if info.aux_loss_coef > 0 else None
    z = logits_LRE.logsumexp(-1).square().mean() if info.z_loss_coef > 0 else None
    with torch.no_grad():
        experts_LRK = logits_LRE.topk(info.top_k, dim=-1).indices  # softmax keeps the order: the model's top-k
        counts_LE = torch.zeros(logits_LRE.shape[0], info.num_experts, device=logits_LRE.device)
        counts_LE.scatter_add_(1, experts_LRK.flatten(1), torch.ones_like(experts_LRK.flatten(1), dtype=counts_LE.dtype))
        share_LE = counts_LE / counts_LE.sum(-1, keepdim=True).clamp_min(1)
        imbalance = (share_LE.max(-1).values * info.num_experts).max()
    return RouterTerms(aux, z, imbalance)


def load_balancing_loss(
    model: torch.nn.Module, info: MoEInfo, router_logits: tuple[torch.Tensor, ...], mask_BT: torch.Tensor | None
) -> torch.Tensor:
    """The model family's own load-balancing loss (Switch Transformer), over real tokens only."""
    fn = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    if fn is None:
        raise NotImplementedError(
            f"{type(model).__name__} has no load_balancing_loss_func; set model.moe.aux_loss_coef=0"
        )
    return family_balance_loss(fn, info, router_logits, mask_BT)


def family_balance_loss(
    fn: Any, info: MoEInfo, router_logits: tuple[torch.Tensor, ...], mask_BT: torch.Tensor | None
) -> torch.Tensor:
    """A family's `load_balancing_loss_func` over each layer's [B x T, E] router logits."""
    # fp32 whatever the compute dtype (rltrain.runtime.precision): a loss, like the log-probabilities
    return fn(tuple(r.float() for r in router_logits), info.num_experts, info.top_k, mask_BT)


# --- router replay (docs/moe.md, "Router replay") ---------------------------------------------

ROUTING_DTYPE = torch.int16  # expert ids; -1: no recorded routing (a prompt token, an observation)


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each MoE layer's router, in layer order: transformers 5's `<Family>TopKRouter` (Qwen2-MoE,
    Qwen3-MoE, Mixtral, OLMoE), whose forward returns (logits, top-k weights, top-k experts)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


class RoutingRecorder:
    """The rollout engine's side of router replay: while `recording(rows)` is open, each forward
    of the model keeps, per MoE layer, the experts its router chose for the *last* position of
    every row (a decode step's only position; the prompt's last at prefill): the routing of the
    forward that sampled the next token. `take()` gives [rows, forwards, layers, k]."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = routers(model)
        self._rows = 0
        self._steps: list[list[torch.Tensor]] = [[] for _ in self.routers]

    def _hook(self, layer: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        experts_NK = output[2]
        # stays on the device: one copy to the host per batch (`take`), not one per layer and step
        self._steps[layer].append(experts_NK.view(self._rows, -1, experts_NK.shape[-1])[:, -1].to(ROUTING_DTYPE))

    @contextlib.contextmanager
    def recording(self, rows: int) -> Iterator[None]:
        self._rows, self._steps = rows, [[] for _ in self.routers]
        handles = [r.register_forward_hook(partial(self._hook, layer)) for layer, r in enumerate(self.routers)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def take(self) -> torch.Tensor:
        """[rows, forwards, layers, k] of the last `recording`."""
        per_layer = [torch.stack(steps, dim=1) for steps in self._steps]  # [rows, forwards, k] each
        return torch.stack(per_layer, dim=2).cpu()


def replayed_weights(router: torch.nn.Module, logits_NE: torch.Tensor, experts_NK: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The gate weights of `experts_NK` from the router's own logits, as the family computes them
    for its own top-k: softmax in fp32, the chosen experts' probabilities, renormalised where the
    config's `norm_topk_prob` says (Mixtral has no such key and always renormalises), in `like`'s
    dtype. The router's gradient flows through these weights only (the experts are a choice)."""
    top_NK = torch.softmax(logits_NE.float(), dim=-1).gather(-1, experts_NK)
    if bool(getattr(router, "norm_topk_prob", True)):
        top_NK = top_NK / top_NK.sum(dim=-1, keepdim=True)
    return top_NK.to(like.dtype)


class RouterReplay:
    """The trainer's side: hooks on every router of a MoE model. A scoring forward `load`s the
    recorded experts of its positions ([B x T, layers, k], -1 where nothing was recorded); each
    router then counts where its own top-k set equals the recorded one (`agreement`) and, with
    `replay`, routes recorded positions to the recorded experts (`replayed_weights`). Positions
    without a record keep the router's own choice, bitwise. The load stays until the next one, so
    an activation-checkpointing recompute in the backward pass replays the same experts."""

    def __init__(self, model: torch.nn.Module, replay: bool) -> None:
        self.replay = replay
        self.routers = routers(model)
        self.experts_NLK: torch.Tensor | None = None
        self._counts: dict[int, torch.Tensor] = {}
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(partial(self._hook, layer))

    def load(self, experts_NLK: torch.Tensor | None) -> None:
        if experts_NLK is not None and experts_NLK.shape[1] != len(self.routers):
            raise ValueError(
                f"the recorded routing has {experts_NLK.shape[1]} MoE layers, the model {len(self.routers)}: the rollout "
                "engine's model is not the trainer's"
            )
        self.experts_NLK, self._counts = experts_NLK, {}

    def agreement(self) -> torch.Tensor | None:
        """[agreed, recorded] (token, layer) pairs of the last forward; None without a record."""
        if self.experts_NLK is None or not self._counts:
            return None
        return torch.stack(list(self._counts.values())).sum(0)

    def _hook(self, layer: int, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if self.experts_NLK is None:
            return None
        logits_NE, weights_NK, own_NK = output
        recorded_NK = self.experts_NLK[:, layer].to(own_NK.device, torch.long)
        if recorded_NK.shape != own_NK.shape:
            raise ValueError(
                f"router replay: {tuple(recorded_NK.shape)} recorded experts for {tuple(own_NK.shape)} routed positions"
            )
        has_N = recorded_NK[:, 0] >= 0
        with torch.no_grad():
            same_N = (own_NK.sort(-1).values == recorded_NK.sort(-1).values).all(-1) & has_N
            self._counts[layer] = torch.stack([same_N.sum(), has_N.sum()]).to("cpu", torch.float64)
        if not self.replay or not bool(has_N.any()):
            return None
        chosen_NK = torch.where(has_N[:, None], recorded_NK, own_NK)
        return logits_NE, replayed_weights(module, logits_NE, chosen_NK, weights_NK), chosen_NK
