"""The per-micro-batch state machine, the zero loss from outputs, modes and fault parsing (no
process group: these run in one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rltrain.runtime.errors import UserError
from rltrain.safety import faults
from rltrain.safety.error_kinds import is_programming_error
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


# Real torch errors (raised on CPU) and CUDA ones as torch 2.11 words them (collected on an H100).
_BUGS_ON_CPU = {
    "device (meta vs cpu)": lambda: torch.zeros(2) + torch.zeros(2, device="meta"),
    "dtype (mm)": lambda: torch.mm(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.float64)),
    "dtype (index_add)": lambda: torch.zeros(3).index_add_(0, torch.tensor([0]), torch.zeros(1, dtype=torch.float64)),
    "dtype (cast)": lambda: torch.zeros(3, dtype=torch.long).add_(torch.full((3,), 0.5)),
    "dtype (index)": lambda: torch.gather(torch.zeros(3), 0, torch.zeros(1)),
    "dtype (embedding)": lambda: nn.functional.embedding(torch.zeros(2), torch.zeros(3, 4)),
    "shape (broadcast)": lambda: torch.zeros(3) + torch.zeros(4),
    "shape (view)": lambda: torch.zeros(5).view(2, 3),
    "shape (matmul)": lambda: torch.zeros(2, 3) @ torch.zeros(4, 5),
    "shape (cat)": lambda: torch.cat([torch.zeros(2, 3), torch.zeros(2, 4)]),
    "shape (dim)": lambda: torch.zeros(3).sum(2),
    "shape (cross_entropy)": lambda: nn.functional.cross_entropy(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long)),
    "type": lambda: torch.zeros(2) + None,
    "attribute": lambda: None.mean(),  # type: ignore[attr-defined]
}
_CUDA_MESSAGES = [
    "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
    "Expected all tensors to be on the same device, but got index is on cpu, different from other tensors on "
    "cuda:0 (when checking argument in method wrapper_CUDA__index_select)",
    "Tensor for argument #2 'mat1' is on CPU, but expected it to be on GPU (while checking arguments for addmm)",
    "indices should be either on cpu or on the same device as the indexed tensor (cpu)",
    "expected scalar type Float but found BFloat16",
    "expected mat1 and mat2 to have the same dtype, but got: c10::BFloat16 != float",
    "Expected all tensors to be on the same device, but got target is on cpu, different from other tensors on "
    "cuda:0 (when checking argument in method wrapper_CUDA_nll_loss_forward)",
    "Expected query, key, and value to have the same device type, but got query.device: cuda:0 key.device: cpu "
    "and value.device: cuda:0 instead.",
    "expected scalar type Half but found Float",
    "Index put requires the source and destination dtypes match, got Float for the destination and Double for "
    "the source.",
    "scatter(): Expected self.dtype to be equal to src.dtype",
    "Expected query, key, and value to have the same dtype, but got query.dtype: float key.dtype: "
    "c10::BFloat16 and value.dtype: float instead.",
    "Function GBackward returned an invalid gradient at index 0 - expected device cuda:0 but got cpu",
    "CUDA error: device-side assert triggered",
]


@pytest.mark.parametrize("name", sorted(_BUGS_ON_CPU))
def test_device_dtype_shape_and_type_errors_are_programming_errors(name):
    with pytest.raises(Exception) as info:
        _BUGS_ON_CPU[name]()
    assert is_programming_error(info.value), f"{type(info.value).__name__}: {info.value}"


@pytest.mark.parametrize("message", _CUDA_MESSAGES)
def test_cuda_worded_errors_are_programming_errors(message):
    assert is_programming_error(RuntimeError(message))


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bad batch"),
        KeyError("missing column"),
        RuntimeError("hook failed"),
        faults.InjectedFault("loss_error injected by debug.fault on rank 0 at step 1"),
        IndexError("index 5 is out of bounds for dimension 0 with size 3"),
        AssertionError("len(rows) == len(rewards)"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_about_values_are_not_programming_errors(exc):
    assert not is_programming_error(exc)


def test_a_programming_error_raised_from_is_found_through_the_cause():
    try:
        try:
            torch.zeros(3) + torch.zeros(4)
        except RuntimeError as inner:
            raise RuntimeError("the GRPO loss failed") from inner
    except RuntimeError as outer:
        assert is_programming_error(outer)
    assert not is_programming_error(RuntimeError("wrapped", ValueError("bad batch")))


@pytest.mark.parametrize("bug", ["device", "dtype", "shape"])
def test_recover_mode_re_raises_a_device_dtype_or_shape_bug_at_once(capsys, bug):
    model = _model()
    other = {
        "device": torch.zeros(2, device="meta"),
        "dtype": torch.zeros(2, 2, dtype=torch.float64),
        "shape": torch.zeros(3, 3),
    }[bug]

    def buggy_loss(out):
        return ((out @ other) if bug != "device" else (out + other)).sum(), {}

    with pytest.raises(RuntimeError) as info:
        _run(model, buggy_loss, fail_fast=False)
    notes = "\n".join(info.value.__notes__)
    assert "raised on rank 0" in notes and "not recovered (safety.fail_fast=false)" in notes
    assert "recovered from an error" not in capsys.readouterr().err
    assert params_without_grad(model)  # no zero backward ran: the step stops here


def test_recover_mode_re_raises_a_type_error_before_the_model_runs():
    model = _model()
    guard = MicroBatchGuard(model)
    errors = StepErrors(rank=0, fail_fast=False)

    def failing_input():
        raise TypeError("collate() got an unexpected keyword argument 'pad'")

    with pytest.raises(TypeError, match="unexpected keyword"):
        guarded_micro_batch(guard, errors, failing_input, lambda o: (o.sum(), {}), lambda: model(torch.randn(1, 3)))
    assert errors.recovered == 0 and guard.phase is Phase.START


def test_injected_device_error_is_not_recovered_but_loss_error_is():
    inj = faults.FaultInjector(faults.parse_faults("device_error:0:1,loss_error:0:2"), rank=0)
    model = _model()
    inj.set_step(1)

    def loss_fn(out):
        inj.in_loss()
        return out.sum(), {}

    with pytest.raises(faults.InjectedFault, match="Expected all tensors to be on the same device"):
        _run(model, loss_fn)
    inj.set_step(2)
    guard, errors, result = _run(model, loss_fn)
    assert result is None and errors.recovered == 1


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
