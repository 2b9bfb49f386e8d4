"""The per-micro-batch state machine, the zero loss from outputs, modes and fault parsing (no
process group: these run in one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rltrain.errors import UserError
from rltrain.safety import faults
from rltrain.safety.guard import (
    ErrorBudget,
    MicroBatchGuard,
    Owed,
    Phase,
    StepErrors,
    TooManyErrors,
    UnrecoverableStepError,
    fail_fast_enabled,
    guarded_micro_batch,
    params_without_grad,
    trainable_parameters,
    zero_loss_from_outputs,
)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _run(model, loss_fn, before_backward=None, fail_fast=False):
    x = torch.randn(5, 3)
    guard = MicroBatchGuard(model)
    errors = StepErrors(rank=0, fail_fast=fail_fast)
    result = guarded_micro_batch(guard, errors, lambda: model(x), loss_fn, lambda: model(x[:1]), before_backward)
    return guard, errors, result


def test_success_reaches_done_and_returns_the_loss():
    model = _model()
    guard, errors, result = _run(model, lambda out: (out.sum(), {"m": 1.0}))
    assert guard.phase is Phase.DONE and errors.recovered == 0
    assert result is not None and result[1] == {"m": 1.0}
    assert params_without_grad(model) == []


def test_loss_error_pays_a_zero_backward_that_reaches_every_parameter(capsys):
    model = _model()

    def bad_loss(out):
        raise ValueError("bad batch")

    guard, errors, result = _run(model, bad_loss)
    assert result is None and errors.recovered == 1 and guard.phase is Phase.DONE
    assert params_without_grad(model) == []
    assert all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters())
    err = capsys.readouterr().err
    assert err.count("Traceback") == 1 and "rank 0" in err and "ValueError: bad batch" in err


def test_backward_error_before_the_outputs_is_paid_once_without_double_backward():
    model = _model()

    def explode(grad):
        raise RuntimeError("hook failed")

    guard, errors, result = _run(model, lambda out: (out.sum(), {}), before_backward=lambda loss: loss.register_hook(explode))
    assert result is None and errors.recovered == 1
    assert params_without_grad(model) == []


def test_error_inside_the_model_backward_is_unrecoverable():
    model = _model()
    model[0].weight.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("inside model backward")))
    with pytest.raises(UnrecoverableStepError, match="inside the model's backward"):
        _run(model, lambda out: (out.sum(), {}))


def test_error_inside_the_model_forward_is_unrecoverable():
    model = _model()
    model[2].register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("mid-forward")))
    with pytest.raises(UnrecoverableStepError, match="inside the model's forward"):
        _run(model, lambda out: (out.sum(), {}))


def test_error_before_the_model_runs_uses_a_dummy_forward():
    model = _model()
    guard = MicroBatchGuard(model)
    errors = StepErrors(rank=0, fail_fast=False)

    def failing_input():
        raise KeyError("missing column")

    x = torch.randn(1, 3)
    assert guarded_micro_batch(guard, errors, failing_input, lambda o: (o.sum(), {}), lambda: model(x)) is None
    assert errors.recovered == 1 and params_without_grad(model) == []


def test_fail_fast_re_raises_with_the_rank_noted():
    model = _model()

    def bad_loss(out):
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch") as info:
        _run(model, bad_loss, fail_fast=True)
    assert any("rank 0" in note for note in info.value.__notes__)


def test_owed_by_phase():
    guard = MicroBatchGuard()
    assert guard.owed() is Owed.DUMMY_FORWARD_AND_ZERO_BACKWARD
    for phase in (Phase.OUTPUTS, Phase.LOSS, Phase.BACKWARD):
        guard.phase = phase
        assert guard.owed() is Owed.ZERO_BACKWARD
    guard.phase = Phase.DONE
    assert guard.owed() is Owed.NOTHING
    for phase in (Phase.FORWARD, Phase.MODEL_BACKWARD):
        guard.phase = phase
        with pytest.raises(UnrecoverableStepError):
            guard.owed()


def test_zero_loss_walks_a_list_of_chunks_and_nested_outputs():
    chunks = [nn.Linear(2, 2), nn.Linear(2, 2)]
    x = torch.randn(3, 2)
    h = chunks[0](x)
    outputs = {"logits": chunks[1](h), "aux": (h[:0],), "ignored": 3}
    zero = zero_loss_from_outputs(outputs)
    assert float(zero.detach()) == 0.0
    zero.backward()
    assert params_without_grad(chunks) == []
    names = [n for n, _ in trainable_parameters(chunks)]
    assert names[0].startswith("chunk0.") and names[-1].startswith("chunk1.")


def test_zero_loss_from_an_empty_output_still_reaches_the_parameters():
    lin = nn.Linear(2, 2)
    out = lin(torch.randn(4, 2))[:0]
    zero_loss_from_outputs(out).backward()
    assert params_without_grad(lin) == []


def test_zero_loss_needs_a_graph():
    with pytest.raises(UnrecoverableStepError):
        zero_loss_from_outputs(torch.zeros(3))


def test_error_budget_counts_consecutive_steps():
    budget = ErrorBudget(max_consecutive=2)
    budget.update(1)
    budget.update(0)
    budget.update(2)
    budget.update(1)
    with pytest.raises(TooManyErrors, match="max_consecutive_errors=2"):
        budget.update(1)


@pytest.mark.parametrize(("env", "configured", "expected"), [("", False, False), ("1", False, True), ("0", True, False), ("", True, True)])
def test_env_overrides_fail_fast(monkeypatch, env, configured, expected):
    monkeypatch.setenv("RLTRAIN_FAIL_FAST", env)
    assert fail_fast_enabled(configured) is expected


def test_parse_faults():
    parsed = faults.parse_faults("loss_error:1:3, nan_grad:0:2-4")
    assert parsed == [faults.Fault("loss_error", 1, 3, 3), faults.Fault("nan_grad", 0, 2, 4)]
    assert faults.parse_faults(None) == [] and faults.parse_faults("") == []
    for bad in ("boom:1:3", "loss_error:1", "loss_error:x:3", "loss_error:1:0", "loss_error:1:5-2"):
        with pytest.raises(UserError, match="debug.fault"):
            faults.parse_faults(bad)


def test_injector_fires_once_per_step_on_its_rank_only():
    inj = faults.FaultInjector(faults.parse_faults("loss_error:1:2-3"), rank=1)
    other = faults.FaultInjector(faults.parse_faults("loss_error:1:2-3"), rank=0)
    fired = []
    for step in range(1, 5):
        inj.set_step(step)
        other.set_step(step)
        fired.append((inj.due("loss_error"), inj.due("loss_error"), other.due("loss_error")))
    assert fired == [(False, False, False), (True, False, False), (True, False, False), (False, False, False)]


def test_rollout_dead_wraps_the_ping():
    inj = faults.FaultInjector(faults.parse_faults("rollout_dead:0:3"), rank=0)
    ping = inj.wrap_ping(None)
    inj.set_step(2)
    assert ping() is True
    inj.set_step(3)
    with pytest.raises(faults.InjectedFault):
        ping()
    assert faults.FaultInjector([], rank=0).wrap_ping(None) is None
