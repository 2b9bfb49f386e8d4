"""Weight conversion between Hugging Face (Qwen2/Llama) names and megatron-core GPTModel shards.

Pure tensor code, no process group: the engine gathers tensor-parallel shards and hands them here,
so the weight-format facts (fused q/k/v and gate/up, vocabulary padding, stage offsets, tied embeddings)
live in one place. docs/internals/backends.md lists them.
"""

from __future__ import annotations

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


def stage_param_names(spec: ModelSpec, pp_rank: int, pp: int, output: bool = True) -> list[str]:
    """The megatron parameter names a pipeline stage holds, in export order. `output=False`: the
    stage has no output layer (a critic's, see `value_model`)."""
    names = [EMBED] if pp_rank == 0 else []
    for local in range(len(spec.stage_layers(pp_rank, pp))):
        for suffix in _LAYER_PARAMS:
            if suffix.endswith("linear_qkv.bias") and not spec.qkv_bias:
                continue
            names.append(f"{_LAYER}{local}.{suffix}")
    if pp_rank == pp - 1:
        names.append(FINAL_NORM)
        if output and (not spec.tie_embeddings or pp > 1):
            names.append(OUTPUT)
    return names


def split_dim(name: str) -> int | None:
    """The dimension a parameter is split along across tensor-parallel ranks (None: replicated)."""
    if name in (EMBED, OUTPUT):
        return 0
    if name in (FINAL_NORM, VALUE_HEAD_WEIGHT, VALUE_HEAD_BIAS):
        return None
    return _LAYER_PARAMS[_layer_suffix(name)[1]][0]


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
    qkv_rows = (spec.num_heads + 2 * spec.num_kv_heads) * d // tp
    return {
        "input_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": (qkv_rows, h),
        "self_attention.linear_qkv.bias": (qkv_rows,),
        "self_attention.linear_proj.weight": (h, spec.num_heads * d // tp),
        "pre_mlp_layernorm.weight": (h,),
        "mlp.linear_fc1.weight": (2 * spec.ffn_hidden_size // tp, h),
        "mlp.linear_fc2.weight": (h, spec.ffn_hidden_size // tp),
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
) -> dict[str, torch.Tensor]:
    """This rank's megatron shards, read tensor by tensor through `get_hf(hf_name)`; `output=False`
    leaves out the output layer (neither `lm_head.weight` nor the tied copy is read)."""
    spec.check_split(tp, pp)
    offset = spec.stage_layers(pp_rank, pp).start
    out: dict[str, torch.Tensor] = {}

    def shard(full: torch.Tensor, dim: int | None) -> torch.Tensor:
        return full if dim is None else torch.chunk(full, tp, dim=dim)[tp_rank].contiguous()

    for name in stage_param_names(spec, pp_rank, pp, output):
        if name == EMBED or (name == OUTPUT and spec.tie_embeddings):
            out[name] = shard(_pad_vocab(spec, get_hf("model.embed_tokens.weight"), tp), 0)
        elif name == OUTPUT:
            out[name] = shard(_pad_vocab(spec, get_hf("lm_head.weight"), tp), 0)
        elif name == FINAL_NORM:
            out[name] = get_hf("model.norm.weight").clone()
        else:
            local, suffix = _layer_suffix(name)
            prefix = _hf_layer(offset + local)
            dim, hf_suffix = _LAYER_PARAMS[suffix]
            if suffix.startswith("self_attention.linear_qkv."):
                kind = suffix.rsplit(".", 1)[1]
                q, k, v = (get_hf(f"{prefix}self_attn.{p}_proj.{kind}") for p in "qkv")
                out[name] = shard(_fuse_qkv(spec, q, k, v), 0)
            elif suffix == "mlp.linear_fc1.weight":
                gate = shard(get_hf(f"{prefix}mlp.gate_proj.weight"), 0)
                up = shard(get_hf(f"{prefix}mlp.up_proj.weight"), 0)
                out[name] = torch.cat([gate, up])
            else:
                assert hf_suffix is not None
                out[name] = shard(get_hf(prefix + hf_suffix), dim)
    return out


def megatron_to_hf(
    spec: ModelSpec, name: str, shards: list[torch.Tensor], layer_offset: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors for one megatron parameter, given its shards from every TP rank in order.

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
    if suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]
        for proj, tensor in zip("qkv", _unfuse_qkv(spec, full)):
            yield f"{prefix}self_attn.{proj}_proj.{kind}", tensor
    elif suffix == "mlp.linear_fc1.weight":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        yield f"{prefix}mlp.gate_proj.weight", torch.cat([h[0] for h in halves])
        yield f"{prefix}mlp.up_proj.weight", torch.cat([h[1] for h in halves])
    else:
        hf_suffix = _LAYER_PARAMS[suffix][1]
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
        names += [p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")]
    names.append("model.norm.weight")
    if not spec.tie_embeddings:
        names.append("lm_head.weight")
    return names
