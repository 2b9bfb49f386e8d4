"""Router replay on megatron-core's MoE layers: each recorded position routed to the experts the
rollout engine chose for it (docs/moe.md, "Router replay" and "On megatron").

megatron-core 0.16's `TopKRouter` asks its `router_replay` object for every forward's top-k; its own
`RouterReplay` cannot mix recorded positions with unrecorded ones (a prompt, padding), so
`MegatronRouterReplay` puts a per-layer object in that slot: the router's own top-k, the agreement
with the record, and with replay on the recorded experts where they differ, scored from the
router's own. A micro-batch's record is selected before its forward and again before its backward,
so an activation-checkpointing recompute replays the same experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rltrain.runtime.distributed import control_device

if TYPE_CHECKING:
    from rltrain.backends.megatron.batching import PaddedMicroBatch
    from rltrain.backends.megatron.groups import ParallelCoords
    from rltrain.data.batch import SequenceBatch


class _LayerReplay:
    """The object megatron's router calls (`get_replay_topk`) for one MoE layer."""

    def __init__(self, owner: MegatronRouterReplay, layer: int) -> None:
        self.owner, self.layer = owner, layer

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None, "megatron-core's router passes its own top-k"
        own_NK, own_idx_NK = default_compute_topk(scores, topk, num_groups, group_topk)
        recorded_NK = self.owner.recorded(self.layer)
        if recorded_NK is None:
            return own_NK, own_idx_NK
        recorded_NK = recorded_NK.to(own_idx_NK.device, torch.long)
        if recorded_NK.shape != own_idx_NK.shape:
            raise ValueError(
                f"router replay: {tuple(recorded_NK.shape)} recorded experts for {tuple(own_idx_NK.shape)} routed "
                "positions of megatron's layer"
            )
        has_N = recorded_NK[:, 0] >= 0
        with torch.no_grad():
            same_N = (own_idx_NK.sort(-1).values == recorded_NK.sort(-1).values).all(-1) & has_N
        self.owner.count(self.layer, same_N, has_N)
        swap_N = has_N & ~same_N  # a position whose own set is the record keeps its own order, bitwise
        if not self.owner.replay or not bool(swap_N.any()):
            return own_NK, own_idx_NK
        chosen_NK = torch.where(swap_N[:, None], recorded_NK, own_idx_NK)
        return scores.gather(1, chosen_NK), chosen_NK


class MegatronRouterReplay:
    """Every router of one megatron stage. `select(i, experts_NLK)` before micro-batch i's forward
    and backward ([T x B, layers, k] in megatron's sequence-first order, -1 where nothing was
    recorded; None: no record); `agreement()` sums the [agreed, recorded] (position, layer) pairs
    of the micro-batches since `begin()`. Layer indices are the model's (every layer sparse, so
    `num_layers` of the whole model, on every pipeline stage)."""

    def __init__(self, model: torch.nn.Module, replay: bool, num_layers: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.replay = replay
        self.num_layers = num_layers
        self._experts_NLK: torch.Tensor | None = None
        self._micro_batch = 0
        self._counts: dict[tuple[int, int], torch.Tensor] = {}
        for module in model.modules():
            if isinstance(module, TopKRouter):
                # megatron numbers layers from 1 over the whole model, whatever the pipeline stage
                module.router_replay = _LayerReplay(self, int(module.layer_number) - 1)

    def begin(self) -> None:
        self._counts, self._experts_NLK = {}, None

    def select(self, micro_batch: int, experts_NLK: torch.Tensor | None) -> None:
        if experts_NLK is not None and experts_NLK.shape[1] != self.num_layers:
            raise ValueError(
                f"the recorded routing has {experts_NLK.shape[1]} MoE layers, the model {self.num_layers}: the rollout "
                "engine's model is not the trainer's"
            )
        self._micro_batch, self._experts_NLK = micro_batch, experts_NLK

    def recorded(self, layer: int) -> torch.Tensor | None:
        return self._experts_NLK[:, layer] if self._experts_NLK is not None else None

    def count(self, layer: int, same_N: torch.Tensor, has_N: torch.Tensor) -> None:
        # keyed by micro-batch and layer: a recompute in the backward writes the same counts again;
        # kept on the device until `agreement` (one copy to the host per pass, not one per layer)
        self._counts[(self._micro_batch, layer)] = torch.stack([same_N.sum(), has_N.sum()])

    def agreement(self) -> torch.Tensor:
        """[agreed, recorded] over this stage's layers and the micro-batches since `begin()`."""
        if not self._counts:
            return torch.zeros(2, dtype=torch.float64)
        return torch.stack(list(self._counts.values())).sum(0).to("cpu", torch.float64)


def recorded_experts(batch: SequenceBatch, mb: PaddedMicroBatch) -> torch.Tensor | None:
    """The batch's recorded routing at the positions megatron routes ([T x B, layers, k] in its
    sequence-first order, -1 elsewhere; None without a record): completion token (b, p) at
    position p - 1 of row b (`mb.rows_N`, `mb.cols_N`), the position whose forward sampled it.
    Prompt and padding positions keep the trainer's router (docs/moe.md, "Router replay")."""
    if batch.routing is None or mb.is_dummy:
        return None
    routing_NLK = batch.routing.values
    experts_TBLK = torch.full((mb.seq_len, mb.batch_size, *routing_NLK.shape[1:]), -1, dtype=routing_NLK.dtype)
    experts_TBLK[mb.cols_N.cpu(), mb.rows_N.cpu()] = routing_NLK.cpu()
    return experts_TBLK.flatten(0, 1).to(mb.tokens_BT.device)


def select_routing(
    replay: MegatronRouterReplay | None, batches: list[SequenceBatch], padded: list[PaddedMicroBatch]
) -> Callable[[int], None]:
    """The pipeline schedule's `before_pass` for one pass over `batches`: selects micro-batch i's
    record on this stage's routers (nothing for an engine that reads no routing)."""
    if replay is None:
        return lambda i: None
    replay.begin()
    records = [recorded_experts(b, p) for b, p in zip(batches, padded, strict=True)]
    return lambda i: replay.select(i, records[i])


def agreement_counts(replay: MegatronRouterReplay, coords: ParallelCoords) -> dict[str, float]:
    """This replica's [agreed, recorded] (token, layer) pairs of the last pass as step metrics,
    every pipeline stage's layers summed (collective over the pipeline group); the TP ranks of a
    replica route the same tokens (no sequence parallelism) and hold the same counts. The engine
    sums them over data-parallel ranks and logs their ratio as `moe/router_agreement`."""
    counts = replay.agreement()
    if coords.pp > 1:
        counts = counts.to(control_device())
        dist.all_reduce(counts, group=coords.pp_group)
    agreed, recorded = counts.tolist()
    return {"moe/router_agreed": agreed, "moe/router_recorded": recorded}
