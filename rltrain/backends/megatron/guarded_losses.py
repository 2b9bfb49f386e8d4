"""Loss and backward of the last pipeline stage under the safety guard (see `GuardedLosses`)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from rltrain.backends.base import LossFn, LossMetrics, Scores, scored_output
from rltrain.backends.megatron.batching import PaddedMicroBatch
from rltrain.backends.megatron.groups import ParallelCoords
from rltrain.data.batch import SequenceBatch
from rltrain.data.ragged import Ragged
from rltrain.runtime.distributed import control_device
from rltrain.safety.faults import FaultInjector
from rltrain.safety.guard import (
    MicroBatchGuard,
    Owed,
    StepErrors,
    zero_loss_from_outputs,
)

# score(micro-batch, last stage's output, with_entropy) -> (scored [N], entropy [N] or None)
ScoreFn = Callable[[PaddedMicroBatch, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor | None]]
# router(micro-batch index, its padded batch, loss, metrics) -> (loss, metrics) with a MoE's router losses
RouterLossesFn = Callable[[int, PaddedMicroBatch, torch.Tensor, LossMetrics], tuple[torch.Tensor, LossMetrics]]


class GuardedLosses:
    """The last pipeline stage's loss and backward of one train step, under `rltrain.safety.guard`.

    Only the last stage computes a loss, so only there can a loss or backward error be paid for;
    the zero it backwards is built from the stage's *outputs* as scored (the log-probabilities,
    through the output layer the engine applies; a critic's values, through its value head), so
    every parameter of the stage gets a (zero) gradient, every TP collective of the model's backward
    (the output layer's included) is matched and
    the gradient of the stage's input (zeros) is still sent to the previous stage, whose backward
    then runs as usual. The payment happens where 1F1B schedules the backward (`on_backward`), not
    where the loss failed.

    Tensor parallelism: the TP ranks of the last stage compute the same loss and must backward the
    same one, or their replicated parameters (norms) drift apart. So after each loss the TP ranks
    agree (one MAX all-reduce of a flag) and, if any failed, all backward the zero. A backward
    error cannot be agreed on before it happens: the rank pays its zero backward (the collectives
    still match), sets `mixed`, and the step is skipped on every rank, like a non-finite one.
    """

    def __init__(
        self,
        score: ScoreFn,
        scores: Scores,
        coords: ParallelCoords,
        fail_fast: bool,
        padded: list[PaddedMicroBatch],
        batches: list[SequenceBatch],
        loss_fn: LossFn,
        injector: FaultInjector,
        with_entropy: bool = False,
        router: RouterLossesFn | None = None,
    ) -> None:
        """`router`: a MoE's router losses added to each micro-batch's loss (`router_terms`)."""
        self.score, self.scores = score, scores
        self.router = router
        self.padded, self.batches, self.loss_fn = padded, batches, loss_fn
        self.with_entropy = with_entropy
        self.coords = coords
        self.injector = injector
        self.errors = StepErrors(dist.get_rank(), fail_fast)
        self.sums: dict[str, float] = {}
        self.mixed = False
        self._guards: dict[int, MicroBatchGuard] = {}
        self._zeroed: set[int] = set()
        self._metrics: dict[int, dict[str, float]] = {}

    def _where(self, what: str, i: int) -> str:
        return f"{what} of micro-batch {i} of step {self.injector.step}"

    def _any_tp_rank(self, flag: bool) -> bool:
        if self.coords.tp == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int32, device=control_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.coords.tp_group)
        return bool(int(t))

    def on_output(self, i: int, stage_out: torch.Tensor) -> torch.Tensor:
        """`stage_out`: the last stage's final hidden states, a policy's or a critic's (`score`)."""
        mb = self.padded[i]
        # Scoring holds TP collectives: an error there is a forward error (not guarded, fatal).
        scored_N, entropy_N = self.score(mb, stage_out, self.with_entropy)
        guard = MicroBatchGuard()
        # The scored values, not `stage_out`: a zero backward must pass through the output layer,
        # whose backward all-reduces over TP exactly as the peers' real backward does.
        guard.record_outputs(scored_N)
        self._guards[i] = guard
        # A zero built from the outputs: every parameter stays in the graph (all grads exist, the
        # backward send to the previous stage happens) whatever the loss depends on.
        anchor = 0.0 * scored_N.sum()
        if mb.is_dummy:  # an empty micro-batch: the loss_fn sees no sequences, as on FSDP
            scored_N = scored_N[:0]
            entropy_N = entropy_N[:0] if entropy_N is not None else None
        lens = mb.completion_lens_B
        output = scored_output(
            self.scores,
            Ragged.from_lengths(scored_N, lens),
            Ragged.from_lengths(entropy_N, lens) if entropy_N is not None else None,
            anchor=anchor if mb.is_dummy else None,
        )
        failed = False
        try:
            self.injector.in_loss()
            loss, metrics = self.loss_fn(output, self.batches[i])
            loss = loss + anchor
            if self.router is not None:
                loss, metrics = self.router(i, mb, loss, metrics)
            guard.record_loss(loss)
        except Exception as exc:  # noqa: BLE001 - StepErrors decides: re-raise (fail-fast) or recover
            self.errors.excuse(exc, guard, self._where("the loss", i))
            failed = True
        if self._any_tp_rank(failed):
            if not failed:
                print(
                    f"rltrain: rank {dist.get_rank()}: {self._where('the loss', i)} is replaced by a zero: "
                    "a tensor-parallel peer's loss failed",
                    file=sys.stderr,
                    flush=True,
                )
            self._zeroed.add(i)
            return zero_loss_from_outputs(guard.outputs)
        values = {"loss": float(loss.detach())}
        for key, value in metrics.items():
            if key != "loss":
                values[key] = float(value.detach() if torch.is_tensor(value) else value)
        self._metrics[i] = values
        return loss

    def on_backward(self, i: int, loss: torch.Tensor) -> None:
        guard = self._guards.pop(i)
        try:
            if i in self._zeroed:
                guard.zero_backward()
                return
            self.injector.arm_backward(loss)
            guard.backward(loss)
            for key, value in self._metrics.pop(i).items():
                self.sums[key] = self.sums.get(key, 0.0) + value
        except Exception as exc:  # noqa: BLE001 - StepErrors decides: re-raise or recover
            if self.errors.excuse(exc, guard, self._where("the backward", i)) is Owed.ZERO_BACKWARD:
                guard.zero_backward()
            self._metrics.pop(i, None)
            self.mixed = self.mixed or self.coords.tp > 1
        finally:
            guard.close()
