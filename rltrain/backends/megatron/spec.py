"""The architecture facts shared by model building and weight conversion, read once from HF config.

Kept free of megatron imports so that conversion (and its round-trip tests) is plain tensor code.
Only the Qwen2/Llama family is accepted: RMSNorm, SwiGLU, RoPE without scaling, grouped-query
attention, optional q/k/v bias, tied or untied embeddings. Anything else is refused here with a
message rather than converted wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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

    @staticmethod
    def from_hf_config(config: Any) -> ModelSpec:
        model_type = getattr(config, "model_type", "")
        if model_type not in ("qwen2", "llama"):
            raise ValueError(f"the megatron backend converts qwen2 and llama models, not {model_type!r}")
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
        if model_type == "qwen2" and getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen2 sliding-window attention is not supported")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        qkv_bias = True if model_type == "qwen2" else bool(getattr(config, "attention_bias", False))
        if model_type == "llama" and qkv_bias:
            # Llama's attention_bias also puts a bias on o_proj, which this spec does not carry.
            raise ValueError("llama with attention_bias=true (o_proj bias) is not supported")
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
        )

    def padded_vocab(self, tp: int) -> int:
        """Megatron's vocab-parallel layers need rows divisible by tp; extra rows are masked out."""
        return (self.vocab_size + tp - 1) // tp * tp

    def check_split(self, tp: int, pp: int) -> None:
        """Megatron shards heads, query groups and the MLP evenly over tp and layers over pp."""
        if self.num_heads % tp or self.num_kv_heads % tp:
            raise ValueError(
                f"backend.tp={tp} must divide num_attention_heads={self.num_heads} and "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.ffn_hidden_size % tp:
            raise ValueError(f"backend.tp={tp} must divide intermediate_size={self.ffn_hidden_size}")
        if self.num_layers % pp:
            raise ValueError(f"backend.pp={pp} must divide num_hidden_layers={self.num_layers}")

    def stage_layers(self, pp_rank: int, pp: int) -> range:
        """Global indices of the decoder layers held by pipeline stage `pp_rank`."""
        per_stage = self.num_layers // pp
        return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
