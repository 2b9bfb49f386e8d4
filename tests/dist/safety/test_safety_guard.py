"""Why the zero loss must come from the outputs, and the collective pieces of the guard.

* A zero anchored on one parameter (the tempting shortcut) under FSDP2: the failing rank's backward
  reaches only that parameter's FSDP unit, so its peers wait in collectives that never come (or
  meet mismatched ones). The test runs the output-anchored control first (same model, layout and
  batches: it completes), then expects the parameter-anchored step to fail in a collective or end
  with different weights; if it ever matches the control, the guard's design rule (outputs, never
  a parameter) needs revisiting. More of the control: tests/dist/safety/test_safety_recovery.py.
* A pipeline stage whose loss fails still sends a gradient to the previous stage when the zero is
  built from its output (2 stages, send/recv on gloo).
* Metric key sets that differ between ranks raise a clear error; a rank that recovered an error
  may lack keys and contributes zeros.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from helpers import run_ranks

# Its module-scoped fixture runs once when one pytest-xdist worker runs the whole module.
pytestmark = [pytest.mark.dist, pytest.mark.xdist_group("test_safety_guard")]


def _zero_anchored(rank, world, model_dir, anchor):
    """One SFT step on 2 FSDP2 ranks; rank 1's loss fails and becomes a zero anchored on `anchor`:
    "outputs" (the guard's rule) or "parameter" (one parameter, the tempting shortcut)."""
    from safety_common import make_engine, rank_batch

    from rltrain.algos.sft import sft_loss
    from rltrain.safety.guard import zero_loss_from_outputs

    engine = make_engine(model_dir)
    mb, _ = rank_batch(rank, 1)
    engine.scorer.train()
    out = engine._score(mb, with_entropy=False)
    if rank == 1 and anchor == "parameter":
        loss = engine.lm.model.norm.weight.sum() * 0.0  # the wrong design: anchored on one parameter
    elif rank == 1:
        loss = zero_loss_from_outputs(out)
    else:
        loss, _ = sft_loss(out, mb)
    loss.backward()
    engine.optimizer.step()
    return {k: float(v.double().sum()) for k, v in engine.export_weights()}


def test_zero_loss_anchored_on_a_parameter_hangs_or_fails_under_fsdp2(tiny_cache):
    """The control (zero from the outputs) completes on both ranks; the same step with the zero
    anchored on one parameter either fails in a collective (a timeout or mismatched reduce-scatters)
    or, if the collectives happened to line up, ends with weights that differ from the control's
    (rank 1 owes a zero gradient for every parameter either way, so a correct step would be equal)."""
    from safety_common import tiny_model_dir

    model_dir = tiny_model_dir()
    control = run_ranks(_zero_anchored, model_dir, "outputs", timeout_s=90, pg_timeout_s=20)
    assert control[0] == control[1]
    try:
        anchored = run_ranks(_zero_anchored, model_dir, "parameter", timeout_s=45, pg_timeout_s=6)
    except TimeoutError:
        return  # a rank never came back: the hang the design rule prevents
    except AssertionError as exc:
        # a rank failed: it must be the collective (gloo timeout or mismatch), not the test's own code
        collective = re.compile(r"^\S*(RuntimeError|DistBackendError|DistError): .*(gloo|[Tt]imed out|Connection|mismatch)", re.M)
        assert collective.search(str(exc)), str(exc)[-3000:]
        return
    assert anchored[0] != control[0], (
        "a zero loss anchored on one parameter completed with the same weights as the output-anchored "
        "control under FSDP2: the guard's design rule (outputs, never a parameter) needs revisiting"
    )


def _pipeline(rank, world):
    import torch.distributed as dist

    from rltrain.safety.guard import MicroBatchGuard, StepErrors, guarded_micro_batch

    results = {}
    for failing in (False, True):
        torch.manual_seed(0)
        stage = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)][rank]
        if rank == 0:
            h = stage(torch.randn(3, 4))
            dist.send(h.detach(), 1)
            grad_h = torch.empty_like(h)
            dist.recv(grad_h, 1)  # hangs (pg timeout) if stage 1 never runs a backward to its input
            h.backward(grad_h)
            results[failing] = {"grad": stage.weight.grad.abs().sum().item()}
            continue
        h = torch.empty(3, 4)
        dist.recv(h, 0)
        h.requires_grad_(True)

        def loss_fn(out, failing=failing):
            if failing:
                raise ValueError("loss failed on the last stage")
            return out.sum(), {}

        errors = StepErrors(rank=1, fail_fast=False)
        forward = functools.partial(stage, h)
        guarded_micro_batch(MicroBatchGuard(stage), errors, forward, loss_fn, forward)
        dist.send(h.grad, 0)  # exists because the zero was built from the stage output
        results[failing] = {"recovered": errors.recovered, "input_grad": h.grad.abs().sum().item()}
    return results


def test_pipeline_stage_zero_loss_reaches_the_previous_stage():
    r0, r1 = run_ranks(_pipeline, timeout_s=60, pg_timeout_s=10)
    assert r1[False]["recovered"] == 0 and r0[False]["grad"] > 0
    assert r1[True]["recovered"] == 1
    assert r1[True]["input_grad"] == 0.0 and r0[True]["grad"] == 0.0  # a zero, sent and received


def _metrics(rank, world):
    from rltrain.safety.metrics import MetricKeyMismatch, reduce_metric_sums

    results = {}
    for case in ("same", "extra_key", "partial"):
        metrics = {"loss": 1.0 + rank, "tokens": 2.0}
        if case == "extra_key" and rank == 1:
            metrics["only/rank1"] = 5.0
        if case == "partial" and rank == 1:
            del metrics["tokens"]  # rank 1 recovered an error and lost that micro-batch's metrics
        try:
            results[case] = reduce_metric_sums(metrics, partial=(case == "partial" and rank == 1))
        except MetricKeyMismatch as exc:
            results[case] = str(exc)
    return results


@pytest.fixture(scope="module")
def reduced():
    return run_ranks(_metrics, timeout_s=60, pg_timeout_s=10)


def test_metric_key_mismatch_names_the_rank_and_the_keys(reduced):
    for r in reduced:
        assert isinstance(r["extra_key"], str) and "rank 0 lacks ['only/rank1']" in r["extra_key"]


def test_partial_rank_contributes_zero_for_missing_keys(reduced):
    assert reduced[0]["partial"] == reduced[1]["partial"] == {"loss": 3.0, "tokens": 2.0}


def test_matching_keys_reduce_to_sums(reduced):
    assert reduced[0]["same"] == reduced[1]["same"] == {"loss": 3.0, "tokens": 4.0}
