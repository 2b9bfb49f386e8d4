"""Mixture-of-Experts models under FSDP2: the same graph on every rank, whatever the routing.

transformers' `eager` experts loop only over the experts that received tokens, so the autograd
graph differs per rank; `every_expert_forward` runs every expert every step instead. Router logits
are requested only from a real MoE model that asks for them. docs/internals/models.md has details.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
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


@dataclass
class MoEInfo:
    num_experts: int
    top_k: int
    aux_loss_coef: float  # 0 = no router logits requested
    implementation: str


def prepare_moe(model: PreTrainedModel) -> MoEInfo | None:
    """For a MoE causal LM: make the experts routing-independent (see the module docstring) and
    say whether to request router logits. None for a dense model."""
    config = model.config
    if not is_moe(config):
        return None
    implementation = getattr(config, "_experts_implementation", None) or "eager"
    if implementation == "eager":
        _register_every_expert()
        model.set_experts_implementation(EVERY_EXPERT)
        implementation = EVERY_EXPERT
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    wants_router = bool(getattr(config, "output_router_logits", False)) and coef > 0
    top_k = int(getattr(config, "num_experts_per_tok", 1))
    return MoEInfo(num_experts(config), top_k, coef if wants_router else 0.0, implementation)


def load_balancing_loss(
    model: torch.nn.Module, info: MoEInfo, router_logits: tuple[torch.Tensor, ...], mask_BT: torch.Tensor | None
) -> torch.Tensor:
    """The model family's own load-balancing loss (Switch Transformer), over real tokens only."""
    fn = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    if fn is None:
        raise NotImplementedError(f"{type(model).__name__} has no load_balancing_loss_func; set output_router_logits=false")
    # fp32 whatever the compute dtype (rltrain.runtime.precision): a loss, like the log-probabilities
    return fn(tuple(r.float() for r in router_logits), info.num_experts, info.top_k, mask_BT)
