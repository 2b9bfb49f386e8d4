"""Recover mode on 2 FSDP2 ranks: loss and backward errors, a NaN gradient, the error budget.

One session trains two engines from the same weights on the same per-rank data:
  A, with faults: loss_error on rank 1 at step 2, backward_error on rank 1 at step 3,
     nan_grad on rank 0 at step 5;
  B, without faults, where rank 1 simply has no data at steps 2 and 3.
A recovered micro-batch must contribute exactly a zero gradient and nothing else, so A and B agree
after every step up to 4; step 5 of A must be a no-op on both ranks. A third engine checks the
consecutive-error budget.
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_ranks

# Its module-scoped fixture runs once when one pytest-xdist worker runs the whole module.
pytestmark = [pytest.mark.dist, pytest.mark.xdist_group("test_safety_recovery")]

STEPS = 6
FAULTS = "loss_error:1:2,backward_error:1:3,nan_grad:0:5"


def _session(rank, world, model_dir):
    from safety_common import adam_steps, empty_batch, full_params, make_engine, rank_batch

    from rltrain.algos.sft import sft_loss
    from rltrain.safety.faults import FaultInjector, parse_faults
    from rltrain.safety.guard import params_without_grad

    injector = FaultInjector(parse_faults(FAULTS), rank)  # one run's injector, shared by its engines
    a, b = make_engine(model_dir, faults=injector), make_engine(model_dir, faults=injector)
    missing: dict[int, list[str]] = {}
    a.optimizer.register_step_pre_hook(lambda *_: missing.__setitem__(injector.step, params_without_grad(a.scorer)))
    out = {"a": [], "b": [], "metrics": [], "adam": [], "missing": missing}
    for step in range(1, STEPS + 1):
        mb, total = rank_batch(rank, step)
        injector.set_step(step)
        out["metrics"].append(a.train_step([mb], sft_loss))
        injector.set_step(0)  # B: no faults
        b_mb = empty_batch(total) if rank == 1 and step in (2, 3) else mb
        if step <= 4:
            b.train_step([b_mb], sft_loss)
        out["a"].append({k: float(v.double().sum()) for k, v in full_params(a).items()})
        out["b"].append({k: float(v.double().sum()) for k, v in full_params(b).items()} if step <= 4 else None)
        out["adam"].append(adam_steps(a))
    last = full_params(a)
    out["fingerprint"] = float(sum((v.double() * (i + 1)).sum() for i, v in enumerate(last.values())))
    out["budget"] = _budget(rank, model_dir)
    return out


def _budget(rank, model_dir):
    """Errors at steps 2, 3 and 4 with max_consecutive_errors=2: the third one stops the run."""
    from safety_common import make_engine, rank_batch

    from rltrain.algos.sft import sft_loss
    from rltrain.safety.faults import FaultInjector, parse_faults
    from rltrain.safety.guard import TooManyErrors

    injector = FaultInjector(parse_faults("loss_error:1:2-4"), rank)
    engine = make_engine(model_dir, max_consecutive_errors=2, faults=injector)
    for step in range(1, 6):
        injector.set_step(step)
        try:
            engine.train_step([rank_batch(rank, step)[0]], sft_loss)
        except TooManyErrors as exc:
            return step, str(exc)
    return None, ""


@pytest.fixture(scope="module")
def session(tiny_cache):
    from safety_common import tiny_model_dir

    return run_ranks(_session, tiny_model_dir(), timeout_s=150, pg_timeout_s=20)


def test_parameters_identical_across_ranks_after_every_step(session):
    r0, r1 = session
    for step in range(STEPS):
        assert r0["a"][step] == r1["a"][step], f"ranks differ after step {step + 1}"
    assert r0["fingerprint"] == r1["fingerprint"]


def test_recovered_micro_batch_is_exactly_a_zero_gradient(session):
    r0, _ = session
    for step in range(4):
        for name, value in r0["a"][step].items():
            assert value == pytest.approx(r0["b"][step][name], rel=1e-6, abs=1e-6), (step + 1, name)


def test_every_parameter_gets_a_gradient_on_the_failing_rank(session):
    for r in session:
        for step in (2, 3):
            assert r["missing"][step] == [], (step, r["missing"][step])


def test_recovered_errors_counted_once_per_fault(session):
    for r in session:
        recovered = [m["safety/recovered_errors"] for m in r["metrics"]]
        assert recovered == [0, 1, 1, 0, 0, 0]
        assert sum(recovered) == 2  # loss_error + backward_error; the NaN is a skip, not an error


def test_nan_grad_skips_the_step_on_every_rank(session):
    for r in session:
        skipped = [m["safety/skipped_steps"] for m in r["metrics"]]
        assert skipped == [0, 0, 0, 0, 1, 0]
        assert r["a"][4] == r["a"][3], "parameters moved on the skipped step"
        assert r["adam"][4] == r["adam"][3], "the optimizer step counter advanced on the skipped step"
        lrs = [m["lr"] for m in r["metrics"]]
        assert lrs[5] == lrs[4], "the LR schedule advanced past a skipped step"
        assert lrs[4] > lrs[3] > lrs[2]  # warm-up: it would have moved
        assert not torch.isfinite(torch.tensor(r["metrics"][4]["grad_norm"]))


def test_too_many_consecutive_errors_stop_every_rank_together(session):
    assert [r["budget"][0] for r in session] == [4, 4]  # the same verdict at the same step on both ranks
    assert "safety.max_consecutive_errors=2" in session[0]["budget"][1]
