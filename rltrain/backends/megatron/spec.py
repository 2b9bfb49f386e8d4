"""The architecture facts shared by model building and weight conversion, read once from HF config.

Kept free of megatron imports so that conversion (and its round-trip tests) is plain tensor code.
Only the Qwen2/Llama/Qwen3 family and its Mixture-of-Experts forms (Qwen3-MoE, Qwen2-MoE, Mixtral)
are accepted: RMSNorm, SwiGLU, RoPE without scaling, grouped-query attention, optional q/k/v bias,
optional per-head q/k RMSNorm, tied or untied embeddings, and for a MoE a softmax top-k router over
SwiGLU experts in every layer, optionally beside a sigmoid-gated shared expert (Qwen2-MoE). Anything else is refused here with a message rather than converted wrongly
(docs/moe.md, "Expert parallelism (megatron)").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DENSE_TYPES = ("qwen2", "llama", "qwen3")
MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")


@dataclass(frozen=True)
class MoESpec:
    """A sparse MLP in every layer: `num_experts` SwiGLU experts, each token sent to `topk` of them."""

    num_experts: int
    topk: int
    expert_ffn_size: int  # moe_intermediate_size
    norm_topk_prob: bool  # renormalise the top-k softmax probabilities to sum to one
    shared_expert_ffn_size: int = 0  # Qwen2-MoE: a SwiGLU expert every token uses, sigmoid-gated; 0: none
    # Where the checkpoint keeps a layer's router and experts: `<block>.gate.weight` and
    # `<block>.experts.E.<gate|up|down>.weight` (Mixtral: block_sparse_moe, w1/w3/w2)
    hf_block: str = "mlp"
    hf_expert_linears: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    @staticmethod
    def from_hf_config(config: Any) -> MoESpec:
        if config.model_type == "mixtral":
            if getattr(config, "router_jitter_noise", 0.0):
                raise ValueError("router_jitter_noise > 0 is not supported (the router is deterministic)")
            return MoESpec(
                num_experts=int(config.num_local_experts),
                topk=int(config.num_experts_per_tok),
                expert_ffn_size=int(config.intermediate_size),
                norm_topk_prob=True,  # Mixtral always renormalises its top-k
                hf_block="block_sparse_moe",
                hf_expert_linears=("w1", "w3", "w2"),
            )
        sparse_step = getattr(config, "decoder_sparse_step", 1)
        if sparse_step != 1 or getattr(config, "mlp_only_layers", None):
            raise ValueError(
                f"decoder_sparse_step={sparse_step} / mlp_only_layers={config.mlp_only_layers!r}: the megatron "
                "backend converts MoE models whose every layer is sparse"
            )
        return MoESpec(
            num_experts=int(config.num_experts),
            topk=int(config.num_experts_per_tok),
            expert_ffn_size=int(config.moe_intermediate_size),
            norm_topk_prob=bool(config.norm_topk_prob),
            shared_expert_ffn_size=int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
        )


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int  # Hugging Face rows
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_eps: float
    rope_theta: float
    tie_embeddings: bool
    qkv_bias: bool
    max_positions: int
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's queries and keys before RoPE
    moe: MoESpec | None = None

    @staticmethod
    def from_hf_config(config: Any) -> ModelSpec:
        model_type = getattr(config, "model_type", "")
        if model_type not in DENSE_TYPES + MOE_TYPES:
            known = ", ".join(DENSE_TYPES + MOE_TYPES)
            raise ValueError(f"the megatron backend converts {known} models, not {model_type!r}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (SwiGLU needs silu)")
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type={rope.get('rope_type')!r} is not supported; only unscaled RoPE")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if theta is None:
            raise ValueError("the Hugging Face config names no rope_theta")
        if getattr(config, "mlp_bias", False):
            raise ValueError("mlp_bias=true is not supported")
        if model_type != "llama" and getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        if model_type == "mixtral" and config.sliding_window is not None:
            raise ValueError(f"sliding_window={config.sliding_window}: sliding-window attention is not supported")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        if model_type == "qwen2_moe":
            qkv_bias = bool(config.qkv_bias)
        else:
            qkv_bias = True if model_type == "qwen2" else bool(getattr(config, "attention_bias", False))
        if model_type not in ("qwen2", "qwen2_moe") and qkv_bias:
            # Llama's and Qwen3's attention_bias also puts a bias on o_proj, which this spec does not carry.
            raise ValueError(f"{model_type} with attention_bias=true (o_proj bias) is not supported")
        return ModelSpec(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            ffn_hidden_size=config.intermediate_size,
            rms_eps=float(config.rms_norm_eps),
            rope_theta=float(theta),
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            max_positions=int(getattr(config, "max_position_embeddings", 4096)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            moe=MoESpec.from_hf_config(config) if model_type in MOE_TYPES else None,
        )

    def padded_vocab(self, tp: int) -> int:
        """Megatron's vocab-parallel layers need rows divisible by tp; extra rows are masked out."""
        return (self.vocab_size + tp - 1) // tp * tp

    @property
    def num_experts(self) -> int:
        """0 for a dense model."""
        return 0 if self.moe is None else self.moe.num_experts

    def local_experts(self, ep: int) -> int:
        """Experts held by each rank of an expert-parallel group (every layer the same)."""
        return self.num_experts // ep

    def check_split(self, tp: int, pp: int, ep: int = 1) -> None:
        """Megatron shards heads, query groups and the MLP evenly over tp, layers over pp and each
        layer's experts over ep."""
        if ep > 1 and self.moe is None:
            raise ValueError(f"backend.ep={ep} needs a Mixture-of-Experts model; this one is dense")
        if self.moe is not None and self.moe.num_experts % ep:
            raise ValueError(f"backend.ep={ep} must divide the model's {self.moe.num_experts} experts (num_experts)")
        if self.num_heads % tp or self.num_kv_heads % tp:
            raise ValueError(
                f"backend.tp={tp} must divide num_attention_heads={self.num_heads} and "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.moe is not None and self.moe.shared_expert_ffn_size % tp:
            raise ValueError(f"backend.tp={tp} must divide shared_expert_intermediate_size={self.moe.shared_expert_ffn_size}")
        if self.moe is None and self.ffn_hidden_size % tp:
            raise ValueError(f"backend.tp={tp} must divide intermediate_size={self.ffn_hidden_size}")
        if self.num_layers % pp:
            raise ValueError(f"backend.pp={pp} must divide num_hidden_layers={self.num_layers}")

    def stage_layers(self, pp_rank: int, pp: int) -> range:
        """Global indices of the decoder layers held by pipeline stage `pp_rank`."""
        per_stage = self.num_layers // pp
        return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
