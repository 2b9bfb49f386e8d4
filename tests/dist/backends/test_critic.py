"""The critic engine (PPO's value model) on both backends, against a plain-torch critic.

The reference (in the parent, no engine): the Hugging Face transformer's final hidden states per
sequence (no padding, no packing), the value head drawn from `trainer.seed`, an MSE to fixed
per-token targets over the global token count, one clipped AdamW step. Each layout must match its
values before the step (1e-5), its loss and grad norm (1e-5 relative) and its values after the
step (1e-5): FSDP on 1 rank (length buckets) and on 2 ranks (sharded; shared prompts packed; an
empty micro-batch on one rank), megatron with dp=2, tp=2, and pp=2 on a tied Llama (a critic is
built untied). FSDP on 1 and 2 ranks agree with each other to 1e-6, and megatron's values with
FSDP's to 1e-5. FSDP on 1 rank and megatron tp=2 run with gradient checkpointing (which must
change no number), the others without.

Engines come from `build_engine(ctx, "critic")` with the composed run config and a `critic` node
(`critic.lr` differs from `optim.lr`, which must not be used). The FSDP 2-rank and megatron tp=2
runs also check: a checkpoint round trip restores values and optimizer (the step after loading
equals the step after saving), offload + communicator teardown/re-creation + onload changes no
value, further steps lower the MSE, and asking a critic for log-probabilities or an export (or a
policy for values) is refused with a TypeError.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import compose_config, portable, run_ranks
from test_megatron_engine import _hf_dir, _tensors

# Its module-scoped fixture runs once when one pytest-xdist worker runs the whole module.
pytestmark = [pytest.mark.dist, pytest.mark.xdist_group("test_critic")]

SEED = 3
CRITIC_LR = 2e-4
# eps=1e-4: see test_megatron_engine.OPTIM (keeps Adam from amplifying fp32 summation-order noise).
OPTIM = dict(weight_decay=0.01, beta1=0.9, beta2=0.98, eps=1e-4, warmup_steps=0, schedule="constant", max_grad_norm=1.0)
VOCAB = 128

# Per data-parallel rank, per micro-batch: (prompt_len, completion_len, prompt id); sequences of
# one micro-batch with the same prompt id share their prompt tokens (FSDP packs them).
SHAPES = [
    [[(3, 4, 0), (3, 2, 0), (5, 6, 1)], [(7, 3, 2)], []],
    [[(2, 5, 3)], [(4, 3, 4), (4, 6, 4), (2, 0, 5)], [(6, 2, 6)]],
]


def _data() -> list[list[dict]]:
    """SHAPES as token lists with fixed targets ("returns") per completion token."""
    g = torch.Generator().manual_seed(11)
    prompts: dict[int, list[int]] = {}
    out = []
    for rank_shapes in SHAPES:
        rank_data = []
        for mb in rank_shapes:
            p_lists, c_lists, returns = [], [], []
            for p_len, c_len, pid in mb:
                prompts.setdefault(pid, torch.randint(0, VOCAB, (p_len,), generator=g).tolist())
                p_lists.append(prompts[pid])
                c_lists.append(torch.randint(0, VOCAB, (c_len,), generator=g).tolist())
                returns.append((torch.rand(c_len, generator=g) * 2 - 1).tolist())
            rank_data.append(dict(prompts=p_lists, completions=c_lists, returns=returns))
        out.append(rank_data)
    return out


def _merged(per_rank: list[list[dict]]) -> list[list[dict]]:
    """The same global data on one data-parallel rank: micro-batch i holds every rank's i-th."""
    merged = []
    for parts in zip(*per_rank):
        merged.append({key: [x for part in parts for x in part[key]] for key in ("prompts", "completions", "returns")})
    return [merged]


def _n_tokens(per_rank: list[list[dict]]) -> int:
    return sum(len(c) for rank_data in per_rank for mb in rank_data for c in mb["completions"])


def _config(*overrides: str, lr: float = CRITIC_LR) -> str:
    from omegaconf import OmegaConf, open_dict

    cfg = compose_config(
        f"trainer.seed={SEED}", "optim.lr=0.5", *(f"optim.{k}={v}" for k, v in OPTIM.items()), *overrides
    )
    with open_dict(cfg):
        cfg.critic = OmegaConf.merge(cfg.get("critic") or {}, {"path": None, "lr": lr})
    return OmegaConf.to_yaml(cfg)


# -- the plain-torch reference ---------------------------------------------------------------


def _reference(model_dir: Path, merged: list[dict], n_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    from rltrain.backends.value_head import head_values, new_value_head

    body = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).model
    head = new_value_head(body.config.hidden_size, SEED, torch.float32)
    params = list(body.parameters()) + list(head.parameters())

    def values_and_loss() -> tuple[list[torch.Tensor], torch.Tensor]:
        values, loss = [], torch.zeros(())
        for mb in merged:
            for prompt, completion, returns in zip(mb["prompts"], mb["completions"], mb["returns"]):
                hidden_TH = body(torch.tensor([prompt + completion])).last_hidden_state[0]
                v = head_values(head, hidden_TH[len(prompt) - 1 : len(prompt) - 1 + len(completion)])
                values.append(v)
                loss = loss + ((v - torch.tensor(returns)) ** 2).sum() / n_tokens
        return values, loss

    before, loss = values_and_loss()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, OPTIM["max_grad_norm"])
    torch.optim.AdamW(
        params, lr=CRITIC_LR, betas=(OPTIM["beta1"], OPTIM["beta2"]), eps=OPTIM["eps"],
        weight_decay=OPTIM["weight_decay"], foreach=False,
    ).step()
    with torch.no_grad():
        after, _ = values_and_loss()
    return dict(
        before=torch.cat([v.detach() for v in before]), after=torch.cat(after), loss=float(loss.detach()), grad_norm=float(grad_norm)
    )


# -- the worker -------------------------------------------------------------------------------


def _batches(rank_data: list[dict]):
    from rltrain.data.batch import SequenceBatch
    from rltrain.data.ragged import Ragged

    out = []
    for mb in rank_data:
        returns = [torch.tensor(r, dtype=torch.float32) for r in mb["returns"]]
        extras = {"returns": Ragged.from_list(returns)} if returns else {}
        out.append(SequenceBatch.from_lists(mb["prompts"], mb["completions"], **extras))
    return out


def _mse(n_tokens: int):
    """A critic's loss: squared error to the batch's per-token returns over the global count."""

    def loss_fn(out, mb):
        assert out.logps is None and out.values is not None and out.values.values.dtype == torch.float32
        if len(mb) == 0:
            return out.values.values.sum(), {"token_share": torch.zeros(())}
        returns = mb.extras["returns"].values.to(out.values.values.device)
        assert torch.equal(out.values.lengths(), mb.completion_lens()), "values are ragged like the completions"
        loss = ((out.values.values - returns) ** 2).sum() / n_tokens
        return loss, {"token_share": torch.tensor(out.values.num_tokens / n_tokens)}

    return loss_fn


def _values(eng, batches) -> list[torch.Tensor]:
    return [v.values.clone() for v in eng.forward_values(batches)]


def _extras(eng, ctx, batches, n_tokens: int, out_dir: Path) -> dict:
    """Checkpoint round trip, a time-sharing cycle, learning, and the refusals (see module doc)."""
    from rltrain.backends import build_engine

    loss_fn = _mse(n_tokens)
    ckpt = out_dir / "ckpt"
    eng.save_checkpoint(ckpt)
    saved = _values(eng, batches)
    step_after_save = eng.train_step(batches, loss_fn)
    values_after_save = _values(eng, batches)
    eng.train_step(batches, loss_fn)  # move on, then go back
    eng.load_checkpoint(ckpt)
    restored = _values(eng, batches)
    step_after_load = eng.train_step(batches, loss_fn)
    values_after_load = _values(eng, batches)

    eng.offload()
    eng.teardown_communicators()
    eng.recreate_communicators()
    eng.onload()
    after_cycle = _values(eng, batches)

    losses = [eng.train_step(batches, loss_fn)["loss"] for _ in range(6)]

    refusals = []
    for call in (lambda: eng.forward_logps(batches), lambda: list(eng.export_weights()),
                 lambda: eng.save_pretrained(out_dir / "hf"), lambda: build_engine(ctx, "policy", ctx.cfg.trainer.max_steps).forward_values(batches)):
        try:
            call()
            refusals.append("no error")
        except TypeError as exc:
            refusals.append(str(exc))
    return dict(
        saved=saved, restored=restored, step_after_save=step_after_save, step_after_load=step_after_load,
        values_after_save=values_after_save, values_after_load=values_after_load,
        before_cycle=values_after_load, after_cycle=after_cycle, losses=losses, refusals=refusals,
    )


def _worker(rank: int, world: int, cfg_yaml: str, model_dir: str, data, n_tokens: int, out_dir: str, extras: bool) -> dict:
    from omegaconf import OmegaConf

    from rltrain.config.run_context import RunContext
    from rltrain.backends import build_engine
    from rltrain.runtime.distributed import DistInfo

    cfg = OmegaConf.create(cfg_yaml)
    ctx = RunContext(cfg, Path(out_dir), DistInfo(rank, world, rank, torch.device("cpu")), Path(model_dir), None)
    eng = build_engine(ctx, "critic", cfg.trainer.max_steps)
    batches = _batches(data[eng.rank])
    res: dict = dict(dp=eng.rank, before=_values(eng, batches))
    res["metrics"] = eng.train_step(batches, _mse(n_tokens))
    res["after"] = _values(eng, batches)
    if extras:
        res["extras"] = _extras(eng, ctx, batches, n_tokens, Path(out_dir))
    return portable(res)


# -- running a layout and checking it ---------------------------------------------------------


def _global_order(results: list[dict], key: str) -> torch.Tensor:
    """Values of every rank in the reference's order (micro-batch major, then data-parallel rank)."""
    by_dp = {r["dp"]: r[key] for r in results}
    return torch.cat([by_dp[dp][i] for i in range(len(by_dp[0])) for dp in sorted(by_dp)])


def _run(tmp_path: Path, model_dir: Path, overrides: list[str], data, nproc: int, extras: bool = False) -> list[dict]:
    n_tokens = _n_tokens(data)
    cfg = _config(*overrides)
    return _tensors(
        run_ranks(_worker, cfg, str(model_dir), data, n_tokens, str(tmp_path), extras, nproc=nproc, timeout_s=300)
    )


def _check_against_reference(results: list[dict], ref: dict) -> None:
    for res in results:  # the ranks of one replica (tp/pp) return the same values
        twin = next(r for r in results if r["dp"] == res["dp"])
        for key in ("before", "after"):
            assert all(torch.equal(a, b) for a, b in zip(res[key], twin[key]))
    for key in ("before", "after"):
        torch.testing.assert_close(_global_order(results, key), ref[key], atol=1e-5, rtol=0)
    for res in results:
        m = res["metrics"]
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert m["token_share"] == pytest.approx(1.0, rel=1e-6)
        assert m["lr"] == CRITIC_LR and m["safety/skipped_steps"] == 0.0


def _check_extras(results: list[dict]) -> None:
    for res in results:
        ex = res["extras"]
        for a, b in zip(ex["saved"], ex["restored"]):
            assert torch.equal(a, b), "load_checkpoint did not restore the values"
        assert ex["step_after_load"] == ex["step_after_save"], "the step after loading differs (optimizer state?)"
        for a, b in zip(ex["values_after_save"], ex["values_after_load"]):
            assert torch.equal(a, b)
        for a, b in zip(ex["before_cycle"], ex["after_cycle"]):
            assert torch.equal(a, b), "offload/teardown/re-create/onload changed a value"
        first = res["metrics"]["loss"]
        assert ex["losses"][-1] < 0.5 * first, f"the MSE did not fall: {first} -> {ex['losses']}"
        critic_refusals, policy_refusal = ex["refusals"][:3], ex["refusals"][3]
        assert all("a critic" in r for r in critic_refusals), critic_refusals
        assert "only a critic engine has values" in policy_refusal, policy_refusal


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> dict:
    """An untied Qwen2 with random weights (norms too), the data and the plain-torch reference."""
    model_dir = _hf_dir(tmp_path_factory.mktemp("critic_qwen2"), "qwen2", tied=False, kv_heads=2, layers=2, vocab=VOCAB)
    data = _data()
    return dict(model_dir=model_dir, data=data, ref=_reference(model_dir, _merged(data)[0], _n_tokens(data)))


@pytest.fixture(scope="module")
def fsdp_one_rank(qwen2, tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("critic_fsdp1")
    overrides = ["backend=fsdp", "model.gradient_checkpointing=true"]
    return _run(tmp, qwen2["model_dir"], overrides, _merged(qwen2["data"]), nproc=1)


def test_fsdp_critic_one_rank_matches_reference(qwen2, fsdp_one_rank) -> None:
    _check_against_reference(fsdp_one_rank, qwen2["ref"])


def test_fsdp_critic_two_ranks_equal_one_rank(qwen2, fsdp_one_rank, tmp_path: Path) -> None:
    results = _run(tmp_path, qwen2["model_dir"], ["backend=fsdp"], qwen2["data"], nproc=2, extras=True)
    _check_against_reference(results, qwen2["ref"])
    for key in ("before", "after"):
        torch.testing.assert_close(_global_order(results, key), _global_order(fsdp_one_rank, key), atol=1e-6, rtol=0)
    for res in results:
        assert res["metrics"]["loss"] == pytest.approx(fsdp_one_rank[0]["metrics"]["loss"], rel=1e-6)
    _check_extras(results)


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_critic_equals_fsdp_critic(qwen2, fsdp_one_rank, tmp_path: Path, tp: int) -> None:
    """tp=1: two data-parallel ranks; tp=2: one replica whose ranks hold the head replicated."""
    data = qwen2["data"] if tp == 1 else _merged(qwen2["data"])
    overrides = ["backend=megatron", f"backend.tp={tp}", f"model.gradient_checkpointing={str(tp == 2).lower()}"]
    results = _run(tmp_path, qwen2["model_dir"], overrides, data, nproc=2, extras=tp == 2)
    _check_against_reference(results, qwen2["ref"])
    for key in ("before", "after"):
        torch.testing.assert_close(_global_order(results, key), _global_order(fsdp_one_rank, key), atol=1e-5, rtol=0)
    if tp == 2:
        _check_extras(results)


def test_megatron_critic_pp2_on_tied_model(tmp_path: Path) -> None:
    model_dir = _hf_dir(tmp_path / "model", "llama", tied=True, kv_heads=1, layers=4, vocab=VOCAB)
    data = _merged(_data())
    ref = _reference(model_dir, data[0], _n_tokens(data))
    results = _run(tmp_path, model_dir, ["backend=megatron", "backend.pp=2"], data, nproc=2)
    _check_against_reference(results, ref)
