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
    is_expert,
    megatron_shape,
    megatron_to_hf,
    stage_param_names,
)
from rltrain.backends.megatron.spec import ModelSpec, MoESpec

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
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return (d,)
    if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
        return (spec.num_experts, h)
    if name.endswith("shared_expert_gate.weight"):
        return (1, h)
    if ".shared_expert." in name:
        assert spec.moe is not None
        shared = spec.moe.shared_expert_ffn_size
        return (h, shared) if "down_proj" in name else (shared, h)
    if ".experts." in name:
        assert spec.moe is not None
        down = name.endswith(("down_proj.weight", "w2.weight"))
        return (h, spec.moe.expert_ffn_size) if down else (spec.moe.expert_ffn_size, h)
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


def _round_trip(spec: ModelSpec, hf: dict[str, torch.Tensor], tp: int, pp: int, ep: int = 1) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp):
        offset = spec.stage_layers(pp_rank, pp).start
        for ep_rank in range(ep):
            shards = [hf_to_megatron(spec, hf.__getitem__, t, tp, pp_rank, pp, ep_rank=ep_rank, ep=ep) for t in range(tp)]
            for name in stage_param_names(spec, pp_rank, pp, ep=ep):
                if ep_rank and not is_expert(name):
                    continue  # the same on every rank of the expert-parallel group
                for t in range(tp):
                    assert tuple(shards[t][name].shape) == megatron_shape(spec, name, tp), name
                first = ep_rank * spec.local_experts(ep)
                for hf_name, tensor in megatron_to_hf(spec, name, [s[name] for s in shards], offset, first):
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


def _moe_spec(norm_topk_prob: bool = True) -> ModelSpec:
    """Qwen3-MoE's shape."""
    dense = _spec(tied=False, qkv_bias=False, kv_heads=1)
    return ModelSpec(**{**dense.__dict__, "qk_norm": True, "moe": MoESpec(8, 2, 32, norm_topk_prob)})


def _shared_expert_spec() -> ModelSpec:
    """Qwen2-MoE's shape: q/k/v biases, a gated shared expert, no q/k norms."""
    dense = _spec(tied=False, qkv_bias=True, kv_heads=2)
    return ModelSpec(**{**dense.__dict__, "moe": MoESpec(8, 2, 32, False, shared_expert_ffn_size=48)})


def test_moe_round_trip_is_bitwise_exact_for_every_expert_split() -> None:
    """Qwen3-MoE names (q/k norms, router, 8 experts) through every (pp, ep) split and back."""
    spec = _moe_spec()
    hf = _random_hf(spec)
    assert sum(".experts." in n for n in hf) == 4 * 8 * 3  # layers x experts x (gate, up, down)
    for pp, ep in [(1, 1), (1, 2), (2, 4), (1, 8)]:
        back = _round_trip(spec, hf, tp=1, pp=pp, ep=ep)
        assert set(back) == set(hf), (pp, ep)
        assert all(torch.equal(back[n], t) for n, t in hf.items()), (pp, ep)


def test_mixtral_names_round_trip() -> None:
    dense = _spec(tied=False, qkv_bias=False, kv_heads=2)
    moe = MoESpec(8, 2, 32, True, hf_block="block_sparse_moe", hf_expert_linears=("w1", "w3", "w2"))
    spec = ModelSpec(**{**dense.__dict__, "moe": moe})
    hf = _random_hf(spec)
    assert "model.layers.3.block_sparse_moe.experts.7.w3.weight" in hf
    for tp, pp, ep in [(1, 1, 1), (2, 2, 4)]:
        back = _round_trip(spec, hf, tp=tp, pp=pp, ep=ep)
        assert set(back) == set(hf) and all(torch.equal(back[n], t) for n, t in hf.items()), (tp, pp, ep)
    w1, w3 = hf["model.layers.0.block_sparse_moe.experts.5.w1.weight"], hf["model.layers.0.block_sparse_moe.experts.5.w3.weight"]
    shards = hf_to_megatron(spec, hf.__getitem__, 0, 1, 0, 1, ep_rank=1, ep=2)
    assert torch.equal(shards["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"], torch.cat([w1, w3]))


def test_shared_expert_round_trip_is_bitwise_exact_under_tp_and_ep() -> None:
    spec = _shared_expert_spec()
    hf = _random_hf(spec)
    assert sum(".shared_expert" in n for n in hf) == 4 * 4  # gate, up, down, gate weight per layer
    for tp, pp, ep in [(1, 1, 1), (2, 1, 2), (2, 2, 4)]:
        back = _round_trip(spec, hf, tp=tp, pp=pp, ep=ep)
        assert set(back) == set(hf), (tp, pp, ep)
        assert all(torch.equal(back[n], t) for n, t in hf.items()), (tp, pp, ep)


def test_each_expert_rank_holds_its_block_of_experts_as_gate_up_and_down() -> None:
    spec = _moe_spec()
    hf = _random_hf(spec)
    shards = hf_to_megatron(spec, hf.__getitem__, 0, 1, 0, 1, ep_rank=1, ep=4)  # experts 2 and 3
    assert sum(is_expert(n) for n in shards) == 4 * 2 * 2
    fc1 = shards["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    expert3 = "model.layers.0.mlp.experts.3."
    assert torch.equal(fc1, torch.cat([hf[expert3 + "gate_proj.weight"], hf[expert3 + "up_proj.weight"]]))
    assert torch.equal(shards["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"], hf[expert3 + "down_proj.weight"])
    assert torch.equal(shards["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])


def test_unsupported_expert_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="must divide the model's 8 experts"):
        _moe_spec().check_split(tp=1, pp=1, ep=3)
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model"):
        _spec(tied=True, qkv_bias=True, kv_heads=2).check_split(tp=1, pp=1, ep=2)


def test_spec_reads_a_qwen3_moe_config() -> None:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False)
    spec = ModelSpec.from_hf_config(config)
    assert spec.moe == MoESpec(num_experts=8, topk=2, expert_ffn_size=32, norm_topk_prob=False)
    assert spec.qk_norm and not spec.qkv_bias and spec.head_dim == 32
    config.mlp_only_layers = [1]
    with pytest.raises(ValueError, match="every layer is sparse"):
        ModelSpec.from_hf_config(config)
