"""The TrainEngine protocol: what an algorithm may ask of a training backend.

Algorithms never import a backend: they hand the engine micro-batches and a loss normalised by a
global count, and the engine owns the model, its layout, the optimizer and the collectives, so
micro-batch size, accumulation and rank count do not change the result. docs/internals/backends.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from rltrain.data.batch import SequenceBatch
from rltrain.data.ragged import Ragged

# What an engine's model outputs per completion token: "logps" (policy, reference) or "values" (critic).
Scores = Literal["logps", "values"]


@dataclass
class PolicyOutput:
    """Per completion token, ragged like the batch's completions. A policy's output has `logps`
    (and `values` None); a critic's has `values`, V(state before token t) in fp32 (and `logps` None)."""

    logps: Ragged | None
    entropy: Ragged | None = None
    # For a micro-batch with no sequences: a zero built from the model's outputs. The engine adds
    # it to the loss so that every parameter still gets a gradient and every collective fires.
    anchor: torch.Tensor | None = None
    # A Mixture-of-Experts model's load-balancing loss for this micro-batch (engine-internal: the
    # engine weights and adds it; algorithms ignore it). None for dense models.
    aux_loss: torch.Tensor | None = None
    # The same for its router z-loss, and its load imbalance (a metric): docs/moe.md.
    z_loss: torch.Tensor | None = None
    load_imbalance: torch.Tensor | None = None
    # A critic's values (fp32), ragged exactly like `logps` would be.
    values: Ragged | None = None
    # A MoE's [agreed, recorded] (token, layer) pairs of the engine's recorded routing with its own
    # router's top-k (engine-internal, for `moe/router_agreement`: docs/moe.md). None: no record.
    router_agreement: torch.Tensor | None = None

    def policy_logps(self) -> Ragged:
        """`logps`, for code that holds a policy's output (a critic's has none)."""
        if self.logps is None:
            raise ValueError("this output has no log-probabilities: it is a critic's")
        return self.logps

    def policy_entropy(self) -> Ragged:
        """`entropy`, for code that asked the engine for it (`with_entropy=True`)."""
        if self.entropy is None:
            raise ValueError("this output has no entropy: score with with_entropy=True")
        return self.entropy


def scored_output(
    scores: Scores,
    scored: Ragged,
    entropy: Ragged | None = None,
    anchor: torch.Tensor | None = None,
    aux_loss: torch.Tensor | None = None,
    z_loss: torch.Tensor | None = None,
    load_imbalance: torch.Tensor | None = None,
    router_agreement: torch.Tensor | None = None,
) -> PolicyOutput:
    """The PolicyOutput of an engine that scores `scores`, with `scored` in its field."""
    logps, values = (None, scored) if scores == "values" else (scored, None)
    return PolicyOutput(
        logps=logps, entropy=entropy, anchor=anchor, aux_loss=aux_loss, values=values, z_loss=z_loss,
        load_imbalance=load_imbalance, router_agreement=router_agreement,
    )


def wrong_scores_error(engine: str, scores: Scores, called: str) -> TypeError:
    """The error for asking an engine for the other kind of output (log-probabilities of a critic,
    values of a policy): a bug in the caller, named with what it should call instead."""
    if scores == "values":
        why = "a critic has no log-probabilities; call forward_values"
    else:
        why = "only a critic engine has values; build one with build_engine(ctx, 'critic') and call forward_values"
    return TypeError(f"{engine}.{called}: this engine scores {scores}, so {why}")


# loss_fn(output, micro_batch) -> (loss already divided by the global count, metric contributions
# already divided by their global counts: summing them over micro-batches and ranks gives the mean)
# A loss's metrics: tensors (summed over micro-batches) or plain floats.
LossMetrics = Mapping[str, torch.Tensor | float]
LossFn = Callable[[PolicyOutput, SequenceBatch], tuple[torch.Tensor, LossMetrics]]


class LogProbScorer(Protocol):
    """What a frozen reference is asked: log-probabilities of completion tokens, no gradients. A
    TrainEngine is one; so is a LoRA policy's base (`TrainEngine.base_weights`)."""

    rank: int  # data-parallel rank
    world_size: int  # data-parallel size

    def forward_logps(self, micro_batches: list[SequenceBatch], with_entropy: bool = False) -> list[PolicyOutput]:
        """Each micro-batch's completion-token log-probabilities (and entropies when asked), no
        gradients, on every rank of the engine (a collective under FSDP and Megatron)."""


class Communicators(Protocol):
    """An engine's process groups, torn down before the rollout engine's turn and re-created
    after it by time sharing (rltrain/sync/timeshare.py), identical and warmed up."""

    def teardown(self) -> None:
        """Destroy every group (their communicators' memory freed), on every rank at once."""

    def recreate(self) -> int:
        """Re-create every group; returns how many were created."""


class TrainEngine(Protocol):
    rank: int  # data-parallel rank
    world_size: int  # data-parallel size
    # The engine's process groups, torn down and re-created around the rollout engine's turn by
    # time sharing; None when it has none (one FSDP rank).
    groups: Communicators | None

    def replica_group(self) -> dist.ProcessGroup | None:
        """The process group of the ranks that form this rank's data-parallel replica and so must
        be given identical data (Megatron's tp x pp ranks); None when a replica is one rank."""

    def forward_logps(self, micro_batches: list[SequenceBatch], with_entropy: bool = False) -> list[PolicyOutput]:
        """Scores completion tokens without gradients (policy and reference engines; a critic
        engine raises TypeError)."""

    def forward_values(self, micro_batches: list[SequenceBatch]) -> list[Ragged]:
        """A critic engine's values per completion token, ragged like the completions, in fp32,
        without gradients: value[t] is the value head applied to the hidden state at the position
        that predicts completion token t, i.e. V(state before token t). A policy or reference
        engine raises TypeError."""

    def train_step(
        self, micro_batches: list[SequenceBatch], loss_fn: LossFn, with_entropy: bool = False
    ) -> dict[str, float]:
        """Forward/backward over every micro-batch, one optimizer step. Returns metrics summed
        over micro-batches and ranks, plus `grad_norm` and `lr`. A critic engine hands `loss_fn`
        `PolicyOutput(logps=None, values=<with a graph>)`. `with_entropy`: the outputs
        handed to `loss_fn` carry per-token entropies (detached), so an on-policy algorithm can
        take its metrics from the training pass instead of a separate scoring pass."""

    def base_weights(self) -> LogProbScorer | None:
        """An engine training adapters on a frozen base: that base, scored with the adapters off
        (the reference for free); None for an engine that trains every weight."""

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) tensors under Hugging Face names, for weight sync and export."""

    def save_checkpoint(self, directory: Path) -> None:
        """The model's and optimizer's sharded state under `directory` (torch.distributed.checkpoint),
        every rank writing its shard; `load_checkpoint` restores it on the same layout."""

    def load_checkpoint(self, directory: Path) -> None:
        """Restore what `save_checkpoint` wrote (weights, optimizer state, the steps taken), every rank."""

    def save_pretrained(self, directory: Path) -> None:
        """A Hugging Face model directory (config + safetensors), written by rank 0."""

    def offload(self) -> None:
        """Before the rollout engine's turn (time sharing): gradients dropped, and on an accelerator
        weights and optimizer state moved to host memory."""

    def onload(self) -> None:
        """Bring back what `offload` moved, to the training device, before the trainer's turn."""
