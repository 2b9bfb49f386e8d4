"""Weight conversion between Hugging Face (Qwen2/Llama/Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral) names
and megatron-core GPTModel shards.

Pure tensor code, no process group: the engine gathers tensor-parallel shards (and an expert-parallel
group's experts) and hands them here, so the weight-format facts (fused q/k/v and gate/up, vocabulary
padding, stage offsets, tied embeddings, each rank's slice of the experts) live in one place.
docs/internals/backends.md lists them; docs/moe.md the MoE names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

from rltrain.backends.megatron.spec import ModelSpec

EMBED = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
# A critic's scalar value head on the last stage (megatron.value_model): replicated, never converted.
VALUE_HEAD_WEIGHT = "value_head.weight"
VALUE_HEAD_BIAS = "value_head.bias"
_LAYER = "decoder.layers."

# megatron suffix within a layer -> (tensor-parallel split dim or None, HF suffix within a layer)
_LAYER_PARAMS: dict[str, tuple[int | None, str | None]] = {
    "input_layernorm.weight": (None, "input_layernorm.weight"),
    "self_attention.linear_qkv.weight": (0, None),
    "self_attention.linear_qkv.bias": (0, None),
    "self_attention.linear_proj.weight": (1, "self_attn.o_proj.weight"),
    "pre_mlp_layernorm.weight": (None, "post_attention_layernorm.weight"),
    "mlp.linear_fc1.weight": (0, None),
    "mlp.linear_fc2.weight": (1, "mlp.down_proj.weight"),
}
# Qwen3's per-head q/k RMSNorm (replicated: every TP rank normalises its own heads with the same weight)
_QK_NORM_PARAMS: dict[str, tuple[int | None, str | None]] = {
    "self_attention.q_layernorm.weight": (None, "self_attn.q_norm.weight"),
    "self_attention.k_layernorm.weight": (None, "self_attn.k_norm.weight"),
}
# A MoE layer's router (replicated) and, per expert, SwiGLU weights that stay whole on the expert's rank
ROUTER = "mlp.router.weight"
_MOE_PARAMS: dict[str, tuple[int | None, str | None]] = {ROUTER: (None, "mlp.gate.weight")}
# Qwen2-MoE's shared expert: split over tp like the dense MLP; its gate [1, H] replicated
SHARED_FC1 = "mlp.shared_experts.linear_fc1.weight"
_SHARED_EXPERT_PARAMS: dict[str, tuple[int | None, str | None]] = {
    SHARED_FC1: (0, None),
    "mlp.shared_experts.linear_fc2.weight": (1, "mlp.shared_expert.down_proj.weight"),
    "mlp.shared_experts.gate_weight": (None, "mlp.shared_expert_gate.weight"),
}
# fused [gate; up] weight -> the HF module prefix (within a layer) of its gate_proj and up_proj
_FUSED_FC1 = {"mlp.linear_fc1.weight": "mlp.", SHARED_FC1: "mlp.shared_expert."}
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")
_DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")


def expert_param(local_expert: int, linear: str) -> str:
    """The suffix (within a layer) of a rank's `local_expert`-th expert's fc1 or fc2 weight."""
    return f"mlp.experts.local_experts.{local_expert}.{linear}.weight"


def partial_under_tp(name: str) -> bool:
    """Whether a replicated parameter's gradient on one TP rank covers only that rank's heads (the
    q/k norms), so the TP ranks must sum it."""
    return name.startswith(_LAYER) and _layer_suffix(name)[1] in _QK_NORM_PARAMS


def is_expert(name: str) -> bool:
    """Whether a megatron parameter is one expert's weight (sharded over ep, not replicated over dp)."""
    return _EXPERT.search(name) is not None


def _layer_table(spec: ModelSpec) -> dict[str, tuple[int | None, str | None]]:
    """The per-layer suffixes of this architecture (experts excepted), in export order."""
    table = {k: v for k, v in _LAYER_PARAMS.items() if not (spec.moe is not None and k in _DENSE_MLP)}
    if not spec.qkv_bias:
        del table["self_attention.linear_qkv.bias"]
    if spec.qk_norm:
        table |= _QK_NORM_PARAMS
    if spec.moe is not None:
        table |= {ROUTER: (None, f"{spec.moe.hf_block}.gate.weight")}
    if spec.moe is not None and spec.moe.shared_expert_ffn_size:
        table |= _SHARED_EXPERT_PARAMS
    return table


def stage_param_names(spec: ModelSpec, pp_rank: int, pp: int, output: bool = True, ep: int = 1) -> list[str]:
    """The megatron parameter names a pipeline stage holds, in export order. `output=False`: the
    stage has no output layer (a critic's, see `value_model`). A MoE stage's experts are named by
    their index on each rank of the expert-parallel group (`ep`): the same names on every one."""
    names = [EMBED] if pp_rank == 0 else []
    table = _layer_table(spec)
    for local in range(len(spec.stage_layers(pp_rank, pp))):
        names += [f"{_LAYER}{local}.{suffix}" for suffix in table]
        for expert in range(spec.local_experts(ep)):
            names += [f"{_LAYER}{local}.{expert_param(expert, linear)}" for linear in ("linear_fc1", "linear_fc2")]
    if pp_rank == pp - 1:
        names.append(FINAL_NORM)
        if output and (not spec.tie_embeddings or pp > 1):
            names.append(OUTPUT)
    return names


def split_dim(name: str) -> int | None:
    """The dimension a parameter is split along across tensor-parallel ranks (None: replicated)."""
    if name in (EMBED, OUTPUT):
        return 0
    if name in (FINAL_NORM, VALUE_HEAD_WEIGHT, VALUE_HEAD_BIAS) or is_expert(name):
        return None
    suffix = _layer_suffix(name)[1]
    if suffix in _LAYER_PARAMS:
        return _LAYER_PARAMS[suffix][0]
    return (_QK_NORM_PARAMS | _MOE_PARAMS | _SHARED_EXPERT_PARAMS)[suffix][0]


def _layer_suffix(name: str) -> tuple[int, str]:
    local, suffix = name[len(_LAYER):].split(".", 1)
    return int(local), suffix


def _hf_layer(global_layer: int) -> str:
    return f"model.layers.{global_layer}."


def megatron_shape(spec: ModelSpec, name: str, tp: int) -> tuple[int, ...]:
    """The shape of one TP shard of a megatron parameter (what every TP rank of its stage holds)."""
    h, d = spec.hidden_size, spec.head_dim
    if name in (EMBED, OUTPUT):
        return (spec.padded_vocab(tp) // tp, h)
    if name == FINAL_NORM:
        return (h,)
    suffix = _layer_suffix(name)[1]
    expert = _EXPERT.fullmatch(suffix)
    if expert is not None:
        assert spec.moe is not None  # only a MoE stage has expert parameters
        ffn = spec.moe.expert_ffn_size
        return (2 * ffn, h) if expert.group(2) == "linear_fc1" else (h, ffn)
    qkv_rows = (spec.num_heads + 2 * spec.num_kv_heads) * d // tp
    shared = spec.moe.shared_expert_ffn_size if spec.moe is not None else 0
    return {
        "input_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": (qkv_rows, h),
        "self_attention.linear_qkv.bias": (qkv_rows,),
        "self_attention.linear_proj.weight": (h, spec.num_heads * d // tp),
        "pre_mlp_layernorm.weight": (h,),
        "mlp.linear_fc1.weight": (2 * spec.ffn_hidden_size // tp, h),
        "mlp.linear_fc2.weight": (h, spec.ffn_hidden_size // tp),
        "self_attention.q_layernorm.weight": (d,),
        "self_attention.k_layernorm.weight": (d,),
        ROUTER: (spec.num_experts, h),
        SHARED_FC1: (2 * shared // tp, h),
        "mlp.shared_experts.linear_fc2.weight": (h, shared // tp),
        "mlp.shared_experts.gate_weight": (1, h),
    }[suffix]


def _fuse_qkv(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q/k/v (rows = heads * head_dim) -> megatron's group-interleaved fused rows."""
    groups = spec.num_kv_heads
    tail = q.shape[1:]
    q_G = q.reshape(groups, -1, *tail)
    k_G = k.reshape(groups, -1, *tail)
    v_G = v.reshape(groups, -1, *tail)
    return torch.cat([q_G, k_G, v_G], dim=1).reshape(-1, *tail)


def _unfuse_qkv(spec: ModelSpec, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = spec.num_kv_heads, spec.head_dim
    per_group = spec.num_heads // groups * d
    tail = qkv.shape[1:]
    qkv_G = qkv.reshape(groups, per_group + 2 * d, *tail)
    q, k, v = torch.split(qkv_G, [per_group, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _pad_vocab(spec: ModelSpec, weight_VH: torch.Tensor, tp: int) -> torch.Tensor:
    extra = spec.padded_vocab(tp) - weight_VH.shape[0]
    if extra == 0:
        return weight_VH
    return torch.cat([weight_VH, weight_VH.new_zeros(extra, *weight_VH.shape[1:])])


def hf_to_megatron(
    spec: ModelSpec,
    get_hf: Callable[[str], torch.Tensor],
    tp_rank: int,
    tp: int,
    pp_rank: int,
    pp: int,
    output: bool = True,
    ep_rank: int = 0,
    ep: int = 1,
) -> dict[str, torch.Tensor]:
    """This rank's megatron shards, read tensor by tensor through `get_hf(hf_name)`; `output=False`
    leaves out the output layer (neither `lm_head.weight` nor the tied copy is read). A MoE's
    experts: the `ep_rank`-th contiguous block of each layer's experts."""
    spec.check_split(tp, pp, ep)
    offset = spec.stage_layers(pp_rank, pp).start
    first_expert = ep_rank * spec.local_experts(ep)
    table = _layer_table(spec)
    out: dict[str, torch.Tensor] = {}

    def shard(full: torch.Tensor, dim: int | None) -> torch.Tensor:
        return full if dim is None else torch.chunk(full, tp, dim=dim)[tp_rank].contiguous()

    for name in stage_param_names(spec, pp_rank, pp, output, ep):
        if name == EMBED or (name == OUTPUT and spec.tie_embeddings):
            out[name] = shard(_pad_vocab(spec, get_hf("model.embed_tokens.weight"), tp), 0)
        elif name == OUTPUT:
            out[name] = shard(_pad_vocab(spec, get_hf("lm_head.weight"), tp), 0)
        elif name == FINAL_NORM:
            out[name] = get_hf("model.norm.weight").clone()
        else:
            local, suffix = _layer_suffix(name)
            prefix = _hf_layer(offset + local)
            expert = _EXPERT.fullmatch(suffix)
            if expert is not None:
                out[name] = _expert_from_hf(spec, get_hf, prefix, first_expert + int(expert.group(1)), expert.group(2))
                continue
            dim, hf_suffix = table[suffix]
            if suffix.startswith("self_attention.linear_qkv."):
                kind = suffix.rsplit(".", 1)[1]
                q, k, v = (get_hf(f"{prefix}self_attn.{p}_proj.{kind}") for p in "qkv")
                out[name] = shard(_fuse_qkv(spec, q, k, v), 0)
            elif suffix in _FUSED_FC1:
                gate = shard(get_hf(f"{prefix}{_FUSED_FC1[suffix]}gate_proj.weight"), 0)
                up = shard(get_hf(f"{prefix}{_FUSED_FC1[suffix]}up_proj.weight"), 0)
                out[name] = torch.cat([gate, up])
            else:
                assert hf_suffix is not None
                out[name] = shard(get_hf(prefix + hf_suffix), dim)
    return out


def _hf_expert(spec: ModelSpec, prefix: str, expert: int) -> tuple[str, str, str]:
    """One expert's gate, up and down weight names in the checkpoint (Mixtral: w1, w3, w2)."""
    assert spec.moe is not None  # only a MoE stage has expert parameters
    gate, up, down = (f"{prefix}{spec.moe.hf_block}.experts.{expert}.{n}.weight" for n in spec.moe.hf_expert_linears)
    return gate, up, down


def _expert_from_hf(
    spec: ModelSpec, get_hf: Callable[[str], torch.Tensor], prefix: str, expert: int, linear: str
) -> torch.Tensor:
    """One expert's megatron weight: fc1 = [gate; up] (SwiGLU, like the dense MLP), fc2 = down."""
    gate, up, down = _hf_expert(spec, prefix, expert)
    if linear == "linear_fc1":
        return torch.cat([get_hf(gate), get_hf(up)])
    return get_hf(down).clone()


def megatron_to_hf(
    spec: ModelSpec, name: str, shards: list[torch.Tensor], layer_offset: int, first_expert: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors for one megatron parameter, given its shards from every TP rank in order.
    An expert's weight (never TP-split: one shard) is named for expert `first_expert` + its local
    index, `first_expert` being where its expert-parallel rank's block of experts starts.

    Yields nothing for the tied copy of the embedding on the last pipeline stage.
    """
    dim = split_dim(name)
    full = shards[0] if dim is None else torch.cat(shards, dim=dim)
    if name == EMBED:
        yield "model.embed_tokens.weight", full[: spec.vocab_size]
        return
    if name == OUTPUT:
        if not spec.tie_embeddings:
            yield "lm_head.weight", full[: spec.vocab_size]
        return
    if name == FINAL_NORM:
        yield "model.norm.weight", full
        return
    local, suffix = _layer_suffix(name)
    prefix = _hf_layer(layer_offset + local)
    expert = _EXPERT.fullmatch(suffix)
    if expert is not None:
        gate_name, up_name, down_name = _hf_expert(spec, prefix, first_expert + int(expert.group(1)))
        if expert.group(2) == "linear_fc1":
            gate, up = torch.chunk(full, 2, dim=0)
            yield gate_name, gate
            yield up_name, up
        else:
            yield down_name, full
    elif suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]
        for proj, tensor in zip("qkv", _unfuse_qkv(spec, full)):
            yield f"{prefix}self_attn.{proj}_proj.{kind}", tensor
    elif suffix in _FUSED_FC1:
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        yield f"{prefix}{_FUSED_FC1[suffix]}gate_proj.weight", torch.cat([h[0] for h in halves])
        yield f"{prefix}{_FUSED_FC1[suffix]}up_proj.weight", torch.cat([h[1] for h in halves])
    else:
        hf_suffix = _layer_table(spec)[suffix][1]
        assert hf_suffix is not None
        yield prefix + hf_suffix, full


def hf_param_names(spec: ModelSpec) -> list[str]:
    """Every HF tensor name the conversion reads and writes (lm_head only when untied)."""
    names = ["model.embed_tokens.weight"]
    for layer in range(spec.num_layers):
        p = _hf_layer(layer)
        names.append(p + "input_layernorm.weight")
        for proj in "qkv":
            names.append(f"{p}self_attn.{proj}_proj.weight")
            if spec.qkv_bias:
                names.append(f"{p}self_attn.{proj}_proj.bias")
        names += [p + "self_attn.o_proj.weight", p + "post_attention_layernorm.weight"]
        if spec.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if spec.moe is None:
            names += [p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")]
            continue
        names.append(f"{p}{spec.moe.hf_block}.gate.weight")
        if spec.moe.shared_expert_ffn_size:
            names += [p + f"mlp.shared_expert.{m}_proj.weight" for m in ("gate", "up", "down")]
            names.append(p + "mlp.shared_expert_gate.weight")
        for expert in range(spec.moe.num_experts):
            names += list(_hf_expert(spec, p, expert))
    names.append("model.norm.weight")
    if not spec.tie_embeddings:
        names.append("lm_head.weight")
    return names
