"""The safety guard on the megatron backend (issue 6), on 2 gloo ranks: pp=2 and tp=2.

One spawn per layout; every case starts from the same checkpoint, so each is compared exactly:

- a loss error on rank 1 (the last stage under pp=2; TP rank 1 under tp=2) in recover mode gives
  the weights of a step in which that micro-batch contributed zero, on every rank, and
  `safety/recovered_errors` sums to 1 (under tp=2 both TP ranks backward the zero: they agree);
- a backward error on rank 1: under pp=2 the same weights as the zero-contribution step; under
  tp=2 (the TP ranks' gradients would differ) the step is skipped on every rank;
- NaN grad on rank 0: weights, step counter, Adam's step and the LR unchanged; skipped_steps 1;
- `safety.max_consecutive_errors=0`: the first recovered error stops every rank (TooManyErrors).

Fail-fast (the process exits, the launcher stops its peers) is a CLI test:
tests/e2e/test_safety_megatron_cli.py.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from helpers import portable, run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from test_megatron_engine import OPTIM, _batches, _hf_dir, _tensors  # noqa: E402 - the engine suite's model and batches

# Its module-scoped fixture runs once when one pytest-xdist worker runs the whole module.
pytestmark = [pytest.mark.dist, pytest.mark.xdist_group("test_safety_megatron")]

SHAPES = [[(3, 2), (4, 3)], [(2, 4), (5, 2)]]  # two micro-batches of two sequences each


def _loss_fn(n_tokens: int, zero_micro_batch: int | None = None):
    """SFT loss; `zero_micro_batch`: that micro-batch's loss times 0 (the reference for a
    micro-batch that contributed nothing)."""
    calls = {"n": 0}

    def loss_fn(out, mb):
        i = calls["n"]
        calls["n"] += 1
        loss = -out.logps.values.sum() / n_tokens
        return (loss * 0.0 if i == zero_micro_batch else loss), {}

    return loss_fn


def _worker(rank: int, world: int, model_dir: str, tp: int, pp: int, batches, n_tokens: int, out_dir: str) -> dict:
    from rltrain.backends.megatron.engine import MegatronEngine
    from rltrain.config.group_options import MegatronBackendConfig
    from rltrain.config.schema import OptimConfig, SafetyConfig
    from rltrain.safety.faults import FaultInjector, parse_faults
    from rltrain.safety.guard import ErrorBudget, TooManyErrors

    optim = OptimConfig(**{**OPTIM, "warmup_steps": 8})  # warm-up: the LR moves with every step taken
    eng = MegatronEngine(
        model_dir, MegatronBackendConfig(tp=tp, pp=pp), optim, 10, collective_timeout_s=20, safety=SafetyConfig()
    )
    eng.train_step(batches, _loss_fn(n_tokens))  # a plain first step: the checkpoint holds Adam state
    ckpt = Path(out_dir) / "ckpt"
    eng.save_checkpoint(ckpt)
    initial = dict(eng.export_weights())
    initial_adam = [float(s["step"]) for s in eng.optimizer.state.values() if "step" in s]

    def step(fault: str | None, zero_micro_batch: int | None = None) -> dict:
        eng.load_checkpoint(ckpt)
        eng.faults = FaultInjector(parse_faults(fault), rank)
        eng.faults.set_step(2)
        metrics = eng.train_step(batches, _loss_fn(n_tokens, zero_micro_batch))
        adam = [float(s["step"]) for s in eng.optimizer.state.values() if "step" in s]
        return dict(metrics=metrics, weights=dict(eng.export_weights()), steps=eng.steps_taken, adam=adam)

    res = dict(initial=initial, initial_adam=initial_adam)
    res["reference"] = step(None, zero_micro_batch=0)
    res["loss_error"] = step("loss_error:1:2")
    res["backward_error"] = step("backward_error:1:2")
    res["nan_grad"] = step("nan_grad:0:2")
    eng.load_checkpoint(ckpt)
    eng.error_budget = ErrorBudget(0)
    eng.faults = FaultInjector(parse_faults("loss_error:1:2"), rank)
    eng.faults.set_step(2)
    try:
        eng.train_step(batches, _loss_fn(n_tokens))
        res["budget"] = "no error"
    except TooManyErrors as exc:
        res["budget"] = str(exc)
    return portable(res)


def _run(tmp_path: Path, model_dir: Path, tp: int, pp: int) -> list[dict]:
    batches = _batches(7, 64, SHAPES)
    n_tokens = sum(b.num_completion_tokens for b in batches)
    return _tensors(run_ranks(_worker, str(model_dir), tp, pp, batches, n_tokens, str(tmp_path), timeout_s=150, pg_timeout_s=20))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _check_common(results: list[dict]) -> None:
    for res in results:
        ref, err = res["reference"], res["loss_error"]
        assert all(torch.isfinite(t).all() for t in err["weights"].values())
        assert not _same(ref["weights"], res["initial"])  # the reference step trained on micro-batch 1
        assert _same(err["weights"], ref["weights"]), "a recovered loss error != a zero contribution"
        assert err["metrics"]["safety/recovered_errors"] == 1.0 and ref["metrics"]["safety/recovered_errors"] == 0.0
        assert err["metrics"]["safety/skipped_steps"] == 0.0 and err["steps"] == 2
        nan = res["nan_grad"]
        assert nan["metrics"]["safety/skipped_steps"] == 1.0 and not math.isfinite(nan["metrics"]["grad_norm"])
        assert _same(nan["weights"], res["initial"]) and nan["steps"] == 1 and nan["adam"] == res["initial_adam"]
        assert nan["metrics"]["lr"] == ref["metrics"]["lr"]  # the LR of the second step, not advanced
        assert "1 consecutive steps had errors" in res["budget"]
    assert _same(results[0]["loss_error"]["weights"], results[1]["loss_error"]["weights"])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("safety_megatron_models")
    return {
        "pp": _hf_dir(base / "llama_tied", "llama", tied=True, kv_heads=1, layers=2, vocab=64),
        "tp": _hf_dir(base / "qwen2", "qwen2", tied=False, kv_heads=2, layers=2, vocab=64),
    }


def test_pp2_loss_and_backward_errors_recover_nan_grad_skips(dirs, tmp_path: Path) -> None:
    results = _run(tmp_path, dirs["pp"], tp=1, pp=2)
    _check_common(results)
    for res in results:  # the zero backward from the last stage's logits reaches stage 0 as usual
        bwd = res["backward_error"]
        assert _same(bwd["weights"], res["reference"]["weights"])
        assert bwd["metrics"]["safety/recovered_errors"] == 1.0 and bwd["metrics"]["safety/skipped_steps"] == 0.0


def test_tp2_loss_error_agreed_backward_error_skips(dirs, tmp_path: Path) -> None:
    results = _run(tmp_path, dirs["tp"], tp=2, pp=1)
    _check_common(results)
    for res in results:  # only one TP rank paid a zero backward: its gradients differ, so no rank steps
        bwd = res["backward_error"]
        assert bwd["metrics"]["safety/skipped_steps"] == 1.0 and bwd["metrics"]["safety/recovered_errors"] == 1.0
        assert _same(bwd["weights"], res["initial"]) and bwd["steps"] == 1
