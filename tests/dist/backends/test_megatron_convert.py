"""HF <-> megatron conversion is a bitwise-exact round trip for every tp/pp split (no process group).

Random tensors under every HF name stand in for a checkpoint; each (tp, pp) rank's shards are made
with `hf_to_megatron` and turned back with `megatron_to_hf`, exactly as the engine's export does
after gathering TP shards. Covers tied and untied embeddings, q/k/v bias and none, one and two kv
heads, and a vocabulary that needs padding to split over tp.
"""

from __future__ import annotations

import pytest
import torch

from rltrain.backends.megatron.convert import (
    hf_param_names,
    hf_to_megatron,
    megatron_shape,
    megatron_to_hf,
    stage_param_names,
)
from rltrain.backends.megatron.spec import ModelSpec

pytestmark = pytest.mark.dist


def _spec(tied: bool, qkv_bias: bool, kv_heads: int, vocab: int = 128) -> ModelSpec:
    return ModelSpec(
        vocab_size=vocab,
        hidden_size=64,
        num_layers=4,
        num_heads=2,
        num_kv_heads=kv_heads,
        head_dim=32,
        ffn_hidden_size=128,
        rms_eps=1e-6,
        rope_theta=10000.0,
        tie_embeddings=tied,
        qkv_bias=qkv_bias,
        max_positions=64,
    )


def _hf_shape(spec: ModelSpec, name: str) -> tuple[int, ...]:
    h, d = spec.hidden_size, spec.head_dim
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (spec.vocab_size, h)
    if name.endswith("norm.weight"):
        return (h,)
    rows = {"q": spec.num_heads * d, "k": spec.num_kv_heads * d, "v": spec.num_kv_heads * d}
    for proj, n in rows.items():
        if f"self_attn.{proj}_proj." in name:
            return (n, h) if name.endswith("weight") else (n,)
    if "o_proj" in name:
        return (h, spec.num_heads * d)
    if "down_proj" in name:
        return (h, spec.ffn_hidden_size)
    return (spec.ffn_hidden_size, h)  # gate_proj, up_proj


def _random_hf(spec: ModelSpec) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(_hf_shape(spec, n), generator=g) for n in hf_param_names(spec)}


def _round_trip(spec: ModelSpec, hf: dict[str, torch.Tensor], tp: int, pp: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp):
        shards = [hf_to_megatron(spec, hf.__getitem__, t, tp, pp_rank, pp) for t in range(tp)]
        offset = spec.stage_layers(pp_rank, pp).start
        for name in stage_param_names(spec, pp_rank, pp):
            for t in range(tp):
                assert tuple(shards[t][name].shape) == megatron_shape(spec, name, tp), name
            for hf_name, tensor in megatron_to_hf(spec, name, [s[name] for s in shards], offset):
                assert hf_name not in out, f"{hf_name} exported twice"
                out[hf_name] = tensor
    return out


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("qkv_bias,kv_heads", [(True, 2), (False, 1)])
def test_round_trip_is_bitwise_exact(tied: bool, qkv_bias: bool, kv_heads: int) -> None:
    spec = _spec(tied, qkv_bias, kv_heads)
    hf = _random_hf(spec)
    layouts = [(1, 1), (1, 2), (1, 4)] + ([(2, 1), (2, 2)] if kv_heads % 2 == 0 else [])
    for tp, pp in layouts:
        back = _round_trip(spec, hf, tp, pp)
        assert set(back) == set(hf), (tp, pp)
        for name, tensor in hf.items():
            assert torch.equal(back[name], tensor), (tp, pp, name)


def test_vocab_padding_round_trip_and_zero_pad_rows() -> None:
    spec = _spec(tied=False, qkv_bias=True, kv_heads=2, vocab=127)
    hf = _random_hf(spec)
    back = _round_trip(spec, hf, tp=2, pp=2)
    assert all(torch.equal(back[n], t) for n, t in hf.items())
    last = hf_to_megatron(spec, hf.__getitem__, 1, 2, 1, 2)
    assert last["output_layer.weight"].shape == (64, 64)
    assert torch.equal(last["output_layer.weight"][-1], torch.zeros(64))


def test_fused_layouts_match_megatron_conventions() -> None:
    """q/k/v interleaved per kv group; fc1 shard = [gate shard; up shard]."""
    spec = _spec(tied=True, qkv_bias=True, kv_heads=2)
    hf = _random_hf(spec)
    shard1 = hf_to_megatron(spec, hf.__getitem__, 1, 2, 0, 1)
    qkv = shard1["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(qkv, torch.cat([q[32:64], k[32:64], v[32:64]]))  # TP rank 1 = kv group 1
    fc1 = shard1["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate[64:], up[64:]]))


def test_unsupported_layout_is_refused() -> None:
    spec = _spec(tied=True, qkv_bias=True, kv_heads=1)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        spec.check_split(tp=2, pp=1)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        spec.check_split(tp=1, pp=3)
