"""Megatron's process groups, created under a record so they can be torn down and rebuilt exactly.

Time sharing destroys and re-creates the trainer's communicators; scanning megatron's globals for
groups is fragile, so every group is recorded when it is created and replayed in the same order.
docs/internals/backends.md describes `teardown()`, `recreate()` and the re-binding of handles.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch
import torch.distributed as dist

from rltrain.runtime.distributed import agree_or_raise, control_device


@dataclass(frozen=True)
class GroupSpec:
    """What a group was created with; equal specs in equal order mean identical groups."""

    ranks: tuple[int, ...]
    backend: str | None
    timeout_s: float | None
    use_local_synchronization: bool
    group_desc: str | None


@dataclass
class _Record:
    spec: GroupSpec
    kwargs: dict[str, Any]
    handle: dist.ProcessGroup | None  # None where this rank is not a member


@dataclass
class GroupsSnapshot:
    """Enough to rebuild the same parallel state: megatron's arguments and the group specs."""

    init_kwargs: dict[str, Any]
    specs: list[GroupSpec] = field(default_factory=list)


@dataclass
class ParallelCoords:
    """This rank's coordinates and group handles, read from megatron's parallel state.

    Holds handles: re-read it (`ParallelCoords.current()`) after the groups are re-created.
    """

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Any
    pp_group: Any
    dp_group: Any
    mp_group: Any  # tp x pp
    embd_group: Any  # first and last pipeline stage (tied embeddings); None off those stages
    # Expert parallelism (docs/moe.md): each layer's experts split over `ep` ranks of one stage, which
    # belong to different data-parallel replicas; an expert's copies are summed over `expert_dp_group`
    # and counted once in the gradient norm over `expert_mp_group` (ep x pp).
    ep: int = 1
    ep_rank: int = 0
    ep_group: Any = None
    expert_dp_group: Any = None
    expert_mp_group: Any = None

    @staticmethod
    def current() -> ParallelCoords:
        from megatron.core import parallel_state as ps

        return ParallelCoords(
            tp=ps.get_tensor_model_parallel_world_size(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            dp=ps.get_data_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            dp_group=ps.get_data_parallel_group(),
            mp_group=ps.get_model_parallel_group(),
            embd_group=ps.get_embedding_group() if ps.is_rank_in_embedding_group() else None,
            ep=ps.get_expert_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_group=ps.get_expert_model_parallel_group(),
            expert_dp_group=ps.get_expert_data_parallel_group(),
            expert_mp_group=ps.get_expert_tensor_model_pipeline_parallel_group(),
        )


class ParallelGroups:
    """Owns megatron's parallel state for one engine (tp x pp, data parallel over the rest; a MoE's
    experts over `ep` of the data-parallel ranks, never split over tp)."""

    def __init__(self, tp: int, pp: int, timeout_s: float | None = None, ep: int = 1) -> None:
        world = dist.get_world_size()
        if world % (tp * pp):
            raise ValueError(f"world size {world} is not divisible by tp*pp = {tp}*{pp}")
        if world % (ep * pp):
            raise ValueError(f"world size {world} is not divisible by ep*pp = {ep}*{pp}")
        self.timeout_s = timeout_s
        self.snapshot = GroupsSnapshot(
            init_kwargs=dict(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=1,
                create_gloo_process_groups=False,  # CPU runs use gloo already; GPU runs don't need them
            )
        )
        self._records: list[_Record] = []
        self._roots: list[Any] = []
        self.coords: ParallelCoords | None = None
        self.alive = False

    @property
    def tp(self) -> int:
        return self.snapshot.init_kwargs["tensor_model_parallel_size"]

    @property
    def pp(self) -> int:
        return self.snapshot.init_kwargs["pipeline_model_parallel_size"]

    @property
    def ep(self) -> int:
        return self.snapshot.init_kwargs["expert_model_parallel_size"]

    @staticmethod
    def created(tp: int, pp: int, timeout_s: float | None = None, ep: int = 1) -> ParallelGroups:
        """Megatron's parallel state, initialised now under a record. Megatron keeps it in module
        globals, one per process: the engines of a run share these (`RunContext.shared`)."""
        groups = ParallelGroups(tp, pp, timeout_s=timeout_s, ep=ep)
        groups.create()
        return groups

    # -- creation ---------------------------------------------------------------------------

    def create(self) -> None:
        """Initialise megatron's parallel state, recording every group it creates."""
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            raise RuntimeError(
                "megatron's parallel state is already initialised; one engine owns it per process "
                "(tear the other down first)"
            )
        records: list[_Record] = []
        original = ps.create_group
        me = dist.get_rank()

        def recording_create_group(
            ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False, group_desc=None
        ):
            ranks = list(range(dist.get_world_size())) if ranks is None else [int(r) for r in ranks]
            if self.timeout_s is not None:
                timeout = datetime.timedelta(seconds=self.timeout_s)
            kwargs = dict(
                ranks=ranks,
                timeout=timeout,
                backend=backend,
                pg_options=pg_options,
                use_local_synchronization=use_local_synchronization,
                group_desc=group_desc,
            )
            group = original(**kwargs)
            spec = GroupSpec(
                ranks=tuple(ranks),
                backend=None if backend is None else str(backend),
                timeout_s=None if timeout is None else timeout.total_seconds(),
                use_local_synchronization=bool(use_local_synchronization),
                group_desc=group_desc,
            )
            records.append(_Record(spec, kwargs, group if me in ranks else None))
            return group

        ps.create_group = recording_create_group
        try:
            ps.initialize_model_parallel(**self.snapshot.init_kwargs)
        finally:
            ps.create_group = original
        self._records = records
        self.snapshot.specs = [r.spec for r in records]
        self.coords = ParallelCoords.current()
        self.alive = True
        _ensure_cuda_rng_tracker()

    def handles(self) -> list[dist.ProcessGroup]:
        """This rank's live groups, each once, in creation order."""
        seen: set[int] = set()
        out = []
        for rec in self._records:
            if rec.handle is not None and id(rec.handle) not in seen:
                seen.add(id(rec.handle))
                out.append(rec.handle)
        return out

    # -- teardown and re-creation -----------------------------------------------------------

    def teardown(self) -> None:
        """Destroy every recorded group once and reset megatron's globals; all ranks agree."""
        from megatron.core import parallel_state as ps

        error: BaseException | None = None
        try:
            if not self.alive:
                raise RuntimeError("teardown of process groups that are not alive")
            for handle in self.handles():
                dist.destroy_process_group(handle)
            ps.destroy_model_parallel()
            self.coords = None
            self.alive = False
        except Exception as exc:  # noqa: BLE001 - re-raised below after every rank has voted
            error = exc
        try:
            agree_or_raise(error is None, "process-group teardown")
        except RuntimeError as exc:
            raise exc from error
        if error is not None:  # pragma: no cover - agree_or_raise() already raised
            raise error

    def recreate(self) -> int:
        """Rebuild identical groups, warm each up, re-bind the attached holders' handles.

        Returns how many handle references were re-bound. Raises on every rank if any rank
        failed (or had not torn down), before and after re-creating.
        """
        agree_or_raise(not self.alive, "process-group re-creation (a rank still holds live groups)")
        old = self._records
        error: BaseException | None = None
        try:
            self.create()
            if [r.spec for r in self._records] != [r.spec for r in old]:
                raise RuntimeError("re-created process groups differ from the snapshot taken at teardown")
            for handle in self.handles():
                probe = torch.ones(1, device=control_device())
                dist.all_reduce(probe, group=handle)
                if int(probe) != dist.get_world_size(handle):
                    raise RuntimeError("warm-up all-reduce on a re-created group returned a wrong sum")
            mapping = {
                id(o.handle): n.handle
                for o, n in zip(old, self._records)
                if o.handle is not None and n.handle is not None
            }
            rebound = self.rebind(mapping, self._roots)
            stale = self.stale_handles(self._roots)
            if stale:
                raise RuntimeError(f"stale process-group handles after re-binding: {stale}")
        except Exception as exc:  # noqa: BLE001 - re-raised below after every rank has voted
            error = exc
        try:
            agree_or_raise(error is None, "process-group re-creation")
        except RuntimeError as exc:
            raise exc from error
        return rebound

    def attach(self, *roots: Any) -> None:
        """Objects (models, optimizers, ...) whose group handles `recreate()` must re-bind."""
        self._roots.extend(roots)

    def detach(self, *roots: Any) -> None:
        """Forget `roots` given to `attach`, so a discarded engine's model can be freed while the
        process goes on (scripts/bench_gpu.py builds one engine per workload)."""
        self._roots = [root for root in self._roots if all(root is not gone for gone in roots)]

    # -- handles held elsewhere -------------------------------------------------------------

    def rebind(self, mapping: dict[int, dist.ProcessGroup], roots: Iterable[Any]) -> int:
        """Swap old group handles for new ones in `roots` (modules, optimizers, any object).

        Walks every submodule's attributes, lists/tuples/dicts in them, and dataclasses such as
        megatron's ProcessGroupCollection. Returns how many references were replaced.
        """
        count = 0

        def fix(value: Any) -> Any:
            nonlocal count
            if isinstance(value, dist.ProcessGroup) and id(value) in mapping:
                count += 1
                return mapping[id(value)]
            return value

        for obj in _walk(roots):
            for name, value in list(vars(obj).items()):
                if isinstance(value, list):
                    value[:] = [fix(v) for v in value]
                elif isinstance(value, tuple) and any(isinstance(v, dist.ProcessGroup) for v in value):
                    setattr(obj, name, tuple(fix(v) for v in value))
                elif isinstance(value, dict) and name != "_modules":
                    for k, v in list(value.items()):
                        value[k] = fix(v)
                else:
                    new = fix(value)
                    if new is not value:
                        object.__setattr__(obj, name, new)
        _clear_rotary_caches()
        return count

    def stale_handles(self, roots: Iterable[Any] | None = None) -> list[str]:
        """Descriptions of group references in `roots` that are not among this engine's live groups."""
        roots = self._roots if roots is None else roots
        live = {id(h) for h in self.handles()}
        if dist.group.WORLD is not None:
            live.add(id(dist.group.WORLD))
        stale = []
        for obj in _walk(roots):
            for name, value in vars(obj).items():
                values = value if isinstance(value, (list, tuple)) else list(value.values()) if isinstance(value, dict) else [value]
                for v in values:
                    if isinstance(v, dist.ProcessGroup) and id(v) not in live:
                        stale.append(f"{type(obj).__name__}.{name}")
        return stale


def _walk(roots: Iterable[Any]) -> Iterable[Any]:
    """Every object that may hold a group handle: modules, their submodules, nested dataclasses."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            stack.extend(obj.children())
        if not hasattr(obj, "__dict__"):
            continue
        yield obj
        for value in vars(obj).values():
            if is_dataclass(value) and not isinstance(value, type) and any(
                isinstance(getattr(value, f.name, None), dist.ProcessGroup) for f in fields(value)
            ):
                stack.append(value)


def _clear_rotary_caches() -> None:
    """RotaryEmbedding.forward is lru-cached on its arguments, which may include a group handle."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    cache_clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


def _ensure_cuda_rng_tracker() -> None:
    """On CUDA, register megatron's model-parallel RNG states (its layers fork them around
    initialisation and dropout and fail with "cuda rng state model-parallel-rng is not added"
    otherwise). Seeded from torch's initial seed (`trainer.seed`), so runs stay reproducible; on
    CPU the shims install a CPU tracker instead (cpu_shims)."""
    if not torch.cuda.is_available():
        return
    from megatron.core import tensor_parallel

    if "model-parallel-rng" not in tensor_parallel.get_cuda_rng_tracker().get_states():
        tensor_parallel.model_parallel_cuda_manual_seed(torch.initial_seed() % (2**31), force_reset_rng=True)
