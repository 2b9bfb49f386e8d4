"""MegatronEngine against the Hugging Face model it was converted from, on 2 gloo ranks.

One spawn per layout keeps the suite fast (imports dominate on 2 cores); each run checks:
per-token log-probabilities and entropies of ragged micro-batches (different lengths, an empty
one) against transformers' fp32 model within 1e-5; one SFT step (sum of completion -log p over
the global token count, clipping, AdamW) against the same step in plain torch: loss and grad
norm within 1e-5 relative, updated weights close; export and save_pretrained. The pipeline run
also proves checkpoint save/load and time-sharing teardown/re-creation change nothing.

Layouts: (tp, pp) = (1, 1) on each of 2 data-parallel ranks (different data: DP grad SUM),
(2, 1) on an untied Qwen2 whose vocabulary (127) needs padding, (1, 2) on a tied Llama with one
kv head (the tied embedding lives on both pipeline stages). The single-rank and tp=2 layouts also
run with the chunked vocab-parallel head forced on (three positions per chunk), to the same numbers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import portable, run_ranks

from rltrain.data.batch import SequenceBatch

pytestmark = pytest.mark.dist

# Adam's first step moves each weight by about lr * g / (|g| + eps): with a tiny eps, a gradient
# entry that cancels to ~1e-9 turns fp32 summation-order noise into a visible weight difference.
# eps=1e-4 keeps that amplification below 1e-6, so the weights can be compared tightly.
OPTIM = dict(lr=1e-2, weight_decay=0.01, beta1=0.9, beta2=0.98, eps=1e-4, warmup_steps=0, schedule="constant", max_grad_norm=1.0)


# -- fixtures built in the parent -------------------------------------------------------------


def _hf_dir(path: Path, arch: str, tied: bool, kv_heads: int, layers: int, vocab: int) -> Path:
    """A tiny HF model with every weight (norms and biases too) random, so conversion errors show."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
    )
    config = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common, attention_bias=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.randn_like(p) * 0.15 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path)
    return path


def _batches(seed: int, vocab: int, shapes: list[list[tuple[int, int]]]) -> list[SequenceBatch]:
    """One SequenceBatch per entry of `shapes`, each a list of (prompt_len, completion_len)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for mb in shapes:
        prompts = [torch.randint(0, vocab, (p,), generator=g).tolist() for p, _ in mb]
        completions = [torch.randint(0, vocab, (c,), generator=g).tolist() for _, c in mb]
        out.append(SequenceBatch.from_lists(prompts, completions))
    return out


def _hf_reference(model_dir: Path, batches: list[SequenceBatch], n_tokens: int) -> dict:
    """Per-sequence log-probs/entropy (no padding anywhere) and one clipped AdamW SFT step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logps, entropy, loss = [], [], torch.zeros(())
    for mb in batches:
        for seq, p in zip(mb.tokens.split(), mb.prompt_lens.tolist()):
            logp_TV = torch.log_softmax(model(seq[None]).logits[0].float(), -1)[p - 1 : -1]
            lp = logp_TV.gather(-1, seq[p:, None]).squeeze(-1)
            logps.append(lp.detach())
            entropy.append(-(logp_TV.exp() * logp_TV).sum(-1).detach())
            loss = loss - lp.sum() / n_tokens
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["max_grad_norm"])
    torch.optim.AdamW(
        model.parameters(), lr=OPTIM["lr"], betas=(OPTIM["beta1"], OPTIM["beta2"]), eps=OPTIM["eps"],
        weight_decay=OPTIM["weight_decay"], foreach=False,
    ).step()
    return dict(
        logps=logps, entropy=entropy, loss=float(loss.detach()), grad_norm=float(grad_norm), weights=model.state_dict()
    )


# -- the worker -------------------------------------------------------------------------------


def _sft_loss(n_tokens: int):
    def loss_fn(out, mb):
        nll = -out.logps.values.sum() / n_tokens
        return nll, {"token_share": torch.tensor(out.logps.num_tokens / n_tokens)}

    return loss_fn


def _pg_count() -> int:
    return len(torch.distributed.distributed_c10d._world.pg_map)


def _timeshare(eng, ckpt: Path, batches, n_tokens) -> dict:
    """Step after 3 teardown/re-creation cycles == step without (both from the same checkpoint)."""
    import torch.distributed as dist

    eng.load_checkpoint(ckpt)
    sizes = [_pg_count()]
    old_tp_group = eng.coords.tp_group
    rebound = []
    for _ in range(3):
        eng.teardown_communicators()
        torn = _pg_count()
        rebound.append(eng.recreate_communicators())
        sizes.append(_pg_count())
    old_registered = old_tp_group in torch.distributed.distributed_c10d._world.pg_map
    stale = eng.groups.stale_handles()
    metrics = eng.train_step(batches, _sft_loss(n_tokens))
    weights = dict(eng.export_weights())

    # A teardown that fails on rank 1 raises on both ranks, within the process-group timeout.
    original = dist.destroy_process_group
    if dist.get_rank() == 1:
        def failing(group=None):
            raise OSError("injected teardown failure")

        dist.destroy_process_group = failing
    try:
        eng.teardown_communicators()
        injected = "no error"
    except RuntimeError as exc:
        injected = str(exc)
    finally:
        dist.destroy_process_group = original
    return dict(
        sizes=sizes, torn=torn, rebound=rebound, old_registered=old_registered, stale=stale, metrics=metrics, weights=weights,
        injected=injected,
    )


def _tensors(obj):
    import numpy as np

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tensors(v) for v in obj)
    return obj


def _frozen_and_nonfinite(eng, model_dir: str, batches, n_tokens: int, initial_logps) -> dict:
    """A frozen reference engine shares the policy's groups; a NaN loss on one rank skips the step
    on every rank (weights, step counter unchanged)."""
    from rltrain.backends.megatron.engine import MegatronEngine
    from rltrain.config.group_options import MegatronBackendConfig

    ref = MegatronEngine(model_dir, MegatronBackendConfig(tp=1, pp=1), None, groups=eng.groups)  # joins eng's groups
    ref_logps = [o.logps.values for o in ref.forward_logps(batches)]
    before = dict(eng.export_weights())
    steps = eng.steps_taken

    def nan_on_rank1(out, mb):
        loss = -out.logps.values.sum() / n_tokens
        return (loss * float("nan") if eng.rank == 1 else loss), {}

    metrics = eng.train_step(batches, nan_on_rank1)
    after = dict(eng.export_weights())
    return dict(
        ref_equal=all(torch.equal(a, b[0]) for a, b in zip(ref_logps, initial_logps)),
        skipped=metrics["safety/skipped_steps"],
        unchanged=all(torch.equal(before[n], after[n]) for n in before),
        steps=(steps, eng.steps_taken),
        shared=ref.groups is eng.groups,
    )


def _worker(
    rank: int, world: int, model_dir: str, tp: int, pp: int, data, n_tokens: int, out_dir: str, chunk_positions: int | None
) -> dict:
    from rltrain.backends import chunked_head
    from rltrain.backends.megatron.engine import MegatronEngine
    from rltrain.config.group_options import MegatronBackendConfig
    from rltrain.config.schema import OptimConfig

    if chunk_positions is not None:  # force the chunked vocab-parallel head (logprobs.head_logps)
        chunked_head.CHUNK_ELEMENTS = chunk_positions * 128 // tp

    eng = MegatronEngine(model_dir, MegatronBackendConfig(tp=tp, pp=pp), OptimConfig(**OPTIM), collective_timeout_s=20)
    batches = data[eng.rank]
    res: dict = dict(dp=(eng.rank, eng.world_size))
    outs = eng.forward_logps(batches, with_entropy=True)
    res["logps"] = [(o.logps.values, o.logps.offsets) for o in outs]
    res["entropy"] = [o.entropy.values for o in outs]
    res["export_before"] = dict(eng.export_weights())
    res["rank0_only"] = len(dict(eng.export_weights(to_rank0=True)))
    ckpt = Path(out_dir) / "ckpt"
    eng.save_checkpoint(ckpt)
    res["metrics"] = eng.train_step(batches, _sft_loss(n_tokens))
    res["weights"] = dict(eng.export_weights())
    eng.save_pretrained(Path(out_dir) / "hf")
    if tp * pp == 1 and world == 2:
        res["dp_extras"] = _frozen_and_nonfinite(eng, model_dir, batches, n_tokens, res["logps"])
    if pp > 1:
        res["timeshare"] = _timeshare(eng, ckpt, batches, n_tokens)
    return portable(res)


# -- the checks ------------------------------------------------------------------------------


def _run_layout(
    tmp_path: Path,
    model_dir: Path,
    tp: int,
    pp: int,
    data: list[list[SequenceBatch]],
    nproc: int = 2,
    chunk_positions: int | None = None,
) -> list[dict]:
    n_tokens = sum(b.num_completion_tokens for rank_data in data for b in rank_data)
    results = _tensors(
        run_ranks(
            _worker, str(model_dir), tp, pp, data, n_tokens, str(tmp_path), chunk_positions,
            nproc=nproc, timeout_s=240, pg_timeout_s=20,
        )
    )
    ref = _hf_reference(model_dir, [b for rank_data in data for b in rank_data], n_tokens)

    seq = 0
    for dp_rank, rank_data in enumerate(data):
        owners = [r for r in results if r["dp"][0] == dp_rank]
        assert owners, f"no rank reported data-parallel rank {dp_rank}"
        for res in owners:
            assert res["dp"][1] == len(data)
            s = seq
            for mb, (values, offsets), ent in zip(rank_data, res["logps"], res["entropy"]):
                assert torch.equal(offsets[1:] - offsets[:-1], mb.completion_lens()), "ragged layout"
                for i, lp in enumerate(torch.split(values, mb.completion_lens().tolist())):
                    torch.testing.assert_close(lp, ref["logps"][s + i], atol=1e-5, rtol=0)
                for i, e in enumerate(torch.split(ent, mb.completion_lens().tolist())):
                    torch.testing.assert_close(e, ref["entropy"][s + i], atol=1e-5, rtol=0)
                s += len(mb)
        seq = s

    from safetensors.torch import load_file

    hf_before = load_file(str(next(model_dir.glob("*.safetensors"))))
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for res in results:
        assert set(res["export_before"]) == set(hf_before)
        assert all(torch.equal(res["export_before"][n], t) for n, t in hf_before.items())
        m = res["metrics"]
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert m["token_share"] == pytest.approx(1.0, rel=1e-6)  # fp32 contributions
        assert m["safety/skipped_steps"] == 0.0 and m["lr"] == OPTIM["lr"]
        for name, tensor in res["weights"].items():
            torch.testing.assert_close(tensor, ref["weights"][name], atol=1e-5, rtol=1e-5)
            assert torch.equal(saved[name], results[0]["weights"][name])
    assert [r["rank0_only"] for r in results] == [len(hf_before)] + [0] * (nproc - 1)
    return results


def test_dp2_single_rank_layout(tmp_path: Path) -> None:
    model_dir = _hf_dir(tmp_path / "model", "qwen2", tied=True, kv_heads=1, layers=2, vocab=128)
    data = [
        _batches(1, 128, [[(3, 4), (2, 1), (5, 6)], [(7, 8)], []]),
        _batches(2, 128, [[(1, 2)], [(4, 3), (2, 9)], [(6, 1)]]),
    ]
    results = _run_layout(tmp_path, model_dir, tp=1, pp=1, data=data)
    for res in results:
        extras = res["dp_extras"]
        assert extras["ref_equal"], "a frozen engine sharing the groups scores differently"
        assert extras["shared"] and extras["skipped"] == 1.0 and extras["unchanged"] and extras["steps"] == (1, 1)


# None: the plain head; 3: the chunked vocab-parallel head, three positions per chunk.
@pytest.mark.parametrize("chunk_positions", [None, 3], ids=["plain_head", "chunked_head"])
def test_single_rank(tmp_path: Path, chunk_positions) -> None:
    model_dir = _hf_dir(tmp_path / "model", "qwen2", tied=False, kv_heads=2, layers=2, vocab=128)
    data = [_batches(5, 128, [[(3, 4), (2, 1)], [(6, 5)]])]
    _run_layout(tmp_path, model_dir, tp=1, pp=1, data=data, nproc=1, chunk_positions=chunk_positions)


@pytest.mark.parametrize("chunk_positions", [None, 3], ids=["plain_head", "chunked_head"])
def test_tp2_untied_padded_vocab(tmp_path: Path, chunk_positions) -> None:
    model_dir = _hf_dir(tmp_path / "model", "qwen2", tied=False, kv_heads=2, layers=2, vocab=127)
    data = [_batches(3, 127, [[(3, 4), (2, 1)], [(7, 8), (1, 1), (4, 2)], []])]
    _run_layout(tmp_path, model_dir, tp=2, pp=1, data=data, chunk_positions=chunk_positions)


def test_pp2_ragged_microbatches_checkpoint_and_timesharing(tmp_path: Path) -> None:
    model_dir = _hf_dir(tmp_path / "model", "llama", tied=True, kv_heads=1, layers=4, vocab=128)
    # Micro-batches of different lengths and sizes (DPO-style chosen/rejected), an empty one, and
    # An empty completion too (a prompt with no tokens to score).
    data = [_batches(4, 128, [[(3, 4), (3, 9)], [(2, 1)], [], [(5, 12), (4, 0), (8, 3)]])]
    results = _run_layout(tmp_path, model_dir, tp=1, pp=2, data=data)
    for res in results:
        ts = res["timeshare"]
        assert len(set(ts["sizes"])) == 1, f"process-group registry size changed: {ts['sizes']}"
        assert ts["torn"] < ts["sizes"][0]
        assert min(ts["rebound"]) > 0 and not ts["old_registered"] and ts["stale"] == []
        assert ts["metrics"] == res["metrics"], "a step after teardown/re-creation differs"
        for name, tensor in ts["weights"].items():
            assert torch.equal(tensor, res["weights"][name]), name
        assert "failed on at least one rank" in ts["injected"]

