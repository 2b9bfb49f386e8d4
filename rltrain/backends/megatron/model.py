"""Build one pipeline stage of a megatron-core GPTModel that computes what the HF model computes.

The local layer spec is configured to match Qwen2/Llama/Qwen3 exactly, and for a Mixture of Experts
megatron's MoELayer (softmax top-k router, all-to-all token dispatch over the expert-parallel group,
SequentialMLP experts: grouped GEMM is GPU-only) to match Qwen3-MoE, so the megatron backend can be
checked against the Hugging Face one. docs/internals/backends.md covers precision, activation
checkpointing (torch's, not megatron's) and padding; docs/moe.md expert parallelism.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rltrain.backends.megatron.convert import split_dim
from rltrain.backends.megatron.spec import ModelSpec

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


def moe_config(spec: ModelSpec, ep: int) -> dict:
    """TransformerConfig's MoE fields for `spec` (none for a dense model). The router matches HF:
    softmax in fp32, then top-k renormalised (`norm_topk_prob`, megatron's top-k-then-softmax) or
    not (softmax-then-top-k); no load-balancing loss, no capacity (no token is dropped). A shared
    expert (Qwen2-MoE) is megatron's, gated by a sigmoid of one linear output as in HF."""
    if spec.moe is None:
        return {}
    return dict(
        num_moe_experts=spec.moe.num_experts,
        moe_router_topk=spec.moe.topk,
        moe_ffn_hidden_size=spec.moe.expert_ffn_size,
        moe_router_pre_softmax=not spec.moe.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        moe_shared_expert_intermediate_size=spec.moe.shared_expert_ffn_size or None,
        moe_shared_expert_gate=spec.moe.shared_expert_ffn_size > 0,
    )


def transformer_config(spec: ModelSpec, tp: int, pp: int, dtype: torch.dtype = torch.float32, ep: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,  # megatron then keeps softmax and the like in fp32
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=False,
        **moe_config(spec, ep),
    )


def build_stage(
    spec: ModelSpec, tp: int, pp: int, pp_rank: int, dtype: torch.dtype = torch.float32, ep: int = 1
):
    """This rank's GPTModel stage, bound to megatron's current parallel state. The last stage
    returns final hidden states; the engine applies the output layer (`hidden_out`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from rltrain.backends.megatron.hidden_out import HiddenStatesGPTModel

    spec.check_split(tp, pp, ep)
    layer_spec = get_gpt_layer_local_spec(
        num_experts=spec.moe.num_experts if spec.moe is not None else None,
        normalization="RMSNorm",
        qk_layernorm=spec.qk_norm,
    )
    model = HiddenStatesGPTModel(
        config=transformer_config(spec, tp, pp, dtype, ep),
        transformer_layer_spec=layer_spec,
        vocab_size=spec.padded_vocab(tp),
        max_sequence_length=spec.max_positions,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=spec.rope_theta,
    )
    _mark_tensor_parallel(model)
    if spec.moe is not None and tp > 1:
        _moe_layers_accept_tensor_parallel_input(model)
    if torch.cuda.is_available():
        model = model.cuda()
    return model


def checkpoint_layers(model: GPTModel) -> int:
    """Recompute every decoder layer's activations in the backward instead of keeping them (one
    layer per checkpoint, like megatron's full/uniform/1 recompute). Parameter names do not change
    (the layer's `forward` is wrapped, not the module). Returns the number of layers wrapped."""
    from torch.utils.checkpoint import checkpoint

    layers = list(model.decoder.layers) if hasattr(model, "decoder") else []
    for layer in layers:

        def checkpointed(*args, _forward=layer.forward, **kwargs):
            if not torch.is_grad_enabled():  # scoring passes keep nothing for a backward anyway
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed
    return len(layers)


def _moe_layers_accept_tensor_parallel_input(model: torch.nn.Module) -> None:
    """Let megatron's MoE layers train on tp-replicated hidden states (no sequence parallelism).

    megatron-core refuses that layout in training, because every TP rank then routes the same
    tokens: the layer's output and input gradient are still right on every rank, but each expert's
    gradient is the sum over the tp copies of each token (the engine divides it by tp,
    `grads.sum_expert_grads`). The refusal is the layer's only use of its own `training` flag (its
    router's is untouched, and no aux loss, capacity or CUDA graph is configured), so the layer runs
    its forward with that flag off. docs/moe.md, "Expert parallelism (megatron)"."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for layer in model.modules():
        if not isinstance(layer, MoELayer):
            continue

        def forward(*args, _forward=layer.forward, _layer=layer, **kwargs):
            training, _layer.training = _layer.training, False
            try:
                return _forward(*args, **kwargs)
            finally:
                _layer.training = training

        layer.forward = forward


def _mark_tensor_parallel(model: torch.nn.Module) -> None:
    """Set megatron's TP attributes on sharded weights: megatron sets them only when it initialises
    weights itself (`perform_initialization=True`), and its utilities (norms, checkpoints) read them."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, param in model.named_parameters():
        dim = split_dim(name)
        if dim is not None and not getattr(param, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)


def load_stage_weights(model: torch.nn.Module, shards: dict[str, torch.Tensor]) -> None:
    """Copy converted shards into the stage; any missing or unexpected parameter is an error."""
    params = dict(model.named_parameters())
    if set(params) != set(shards):
        raise RuntimeError(
            f"megatron stage and converted weights disagree: missing {sorted(set(params) - set(shards))}, "
            f"unexpected {sorted(set(shards) - set(params))}"
        )
    with torch.no_grad():
        for name, param in params.items():
            src = shards[name]
            if src.shape != param.shape:
                raise RuntimeError(f"{name}: converted shape {tuple(src.shape)} != stage shape {tuple(param.shape)}")
            param.copy_(src)


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """[1, 1, T, T] bool, True where attention is masked (megatron's convention)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def stage_forward(model, tokens_BT: torch.Tensor | None, seq_len: int, input_TBH: torch.Tensor | None):
    """Run one stage. First stage takes tokens, later stages the previous stage's [T, B, H] output.

    Returns the last stage's final hidden states [B, T, H] (a critic's: [T, B, H]), else the
    hidden states for the next stage [T, B, H].
    """
    device = next(model.parameters()).device
    if input_TBH is not None:
        model.set_input_tensor(input_TBH)
    position_ids_BT = torch.arange(seq_len, device=device).unsqueeze(0)
    if tokens_BT is not None:
        position_ids_BT = position_ids_BT.expand(tokens_BT.shape[0], -1)
    return model(tokens_BT, position_ids_BT, causal_mask(seq_len, device))
