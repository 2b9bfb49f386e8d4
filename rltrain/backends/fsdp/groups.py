"""The FSDP engine's own process group, so that time sharing can tear it down and rebuild it.

The default (WORLD) group belongs to the launcher and cannot be destroyed, so the engine shards over
a group it creates and records, and re-binds FSDP2's cached handles after re-creation.
docs/internals/backends.md explains the re-binding.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rltrain.runtime.distributed import agree_or_raise, control_device, gather_rows


class FSDPGroups:
    """One sharding group over every rank, its mesh, and the modules that use it; with `cp` > 1
    also this rank's context-parallel group (`cp` consecutive ranks: one data-parallel replica,
    docs/long-sequences.md). FSDP shards over every rank, cp ranks included."""

    def __init__(self, device_type: str, timeout_s: float | None = None, cp: int = 1) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        self.ranks = list(range(dist.get_world_size()))
        self.timeout_s = timeout_s
        self.cp = cp
        self.group: dist.ProcessGroup | None = self._new_group()
        self._cp_group: dist.ProcessGroup | None = self._new_cp_group()
        self.mesh = DeviceMesh.from_group(self.group, device_type)
        self._roots: list[nn.Module] = []
        self._destroyed: dist.ProcessGroup | None = None  # the handle FSDP's state still caches
        self.alive = True

    def _new_group(self) -> dist.ProcessGroup:
        timeout = datetime.timedelta(seconds=self.timeout_s) if self.timeout_s is not None else None
        group = dist.new_group(self.ranks, timeout=timeout, group_desc="rltrain_fsdp_shard")
        assert group is not None  # every rank is a member
        return group

    def _new_cp_group(self) -> dist.ProcessGroup | None:
        """Every rank creates every cp group (new_group is collective) and keeps its own."""
        if self.cp == 1:
            return None
        timeout = datetime.timedelta(seconds=self.timeout_s) if self.timeout_s is not None else None
        mine = None
        for first in range(0, len(self.ranks), self.cp):
            members = self.ranks[first : first + self.cp]
            group = dist.new_group(members, timeout=timeout, group_desc="rltrain_fsdp_cp")
            if dist.get_rank() in members:
                mine = group
        return mine

    @property
    def cp_group(self) -> dist.ProcessGroup:
        """This rank's context-parallel group (re-read on every call: time sharing re-creates it)."""
        if self._cp_group is None:
            raise RuntimeError("no live context-parallel group (backend.cp=1, or torn down for time sharing)")
        return self._cp_group

    def attach(self, *roots: nn.Module) -> None:
        """Modules sharded over this group (their FSDP state is re-bound on re-creation)."""
        self._roots.extend(roots)

    def handles(self) -> list[dist.ProcessGroup]:
        return [g for g in (self.group, self._cp_group) if g is not None]

    def teardown(self) -> None:
        """Destroy the sharding group (collective over every rank; all ranks agree)."""
        error: BaseException | None = None
        try:
            if not self.alive or self.group is None:
                raise RuntimeError("teardown of an FSDP process group that is not alive")
            dist.destroy_process_group(self.group)
            if self._cp_group is not None:
                dist.destroy_process_group(self._cp_group)
                self._cp_group = None
            self._destroyed, self.group = self.group, None
            self.alive = False
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank by _agree
            error = exc
        agree_or_raise(error is None, "FSDP process-group teardown", error)

    def recreate(self) -> int:
        """Create an identical group, warm it up, re-bind the mesh and every cached handle.
        Returns how many cached handles were re-bound."""
        agree_or_raise(not self.alive, "FSDP process-group re-creation (a rank still holds a live group)", None)
        error: BaseException | None = None
        rebound = 0
        try:
            new = self._new_group()
            self._cp_group = self._new_cp_group()
            probe = torch.ones(1, device=control_device())
            dist.all_reduce(probe, group=new)
            if int(probe) != len(self.ranks):
                raise RuntimeError("warm-up all-reduce on the re-created FSDP group returned a wrong sum")
            # The mesh resolves its group by name on every get_group(); DTensor specs share it.
            self.mesh._dim_group_names = [new.group_name]
            self.mesh._pg_registry = {new.group_name: new}
            rebound = self._rebind(self._destroyed, new)
            self.group, self._destroyed = new, None
            self.alive = True
            stale = self.stale_handles()
            if stale:
                raise RuntimeError(f"stale process-group handles after re-binding: {stale}")
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank by _agree
            error = exc
        agree_or_raise(error is None, "FSDP process-group re-creation", error)
        return rebound

    # -- cached handles ---------------------------------------------------------------------

    def _fsdp_objects(self) -> Iterator[Any]:
        """FSDP's per-module state objects and what they hold (parameter groups, parameters,
        mesh infos): everything that may cache a process-group handle."""
        from torch.distributed.fsdp import FSDPModule

        seen: set[int] = set()
        stack: list[Any] = []
        for root in self._roots:
            for module in root.modules():
                if isinstance(module, FSDPModule):
                    stack.append(module._get_fsdp_state())
        while stack:
            obj = stack.pop()
            if id(obj) in seen or not hasattr(obj, "__dict__"):
                continue
            seen.add(id(obj))
            yield obj
            for value in vars(obj).values():
                items = value if isinstance(value, (list, tuple)) else [value]
                for item in items:
                    if _is_fsdp_internal(item):
                        stack.append(item)

    def _rebind(self, old: dist.ProcessGroup | None, new: dist.ProcessGroup) -> int:
        count = 0
        for obj in self._fsdp_objects():
            for name, value in list(vars(obj).items()):
                if value is old and old is not None:
                    object.__setattr__(obj, name, new)
                    count += 1
        return count

    def stale_handles(self) -> list[str]:
        """Cached handles in the attached modules' FSDP state that are not this live group."""
        return [
            f"{type(obj).__name__}.{name}"
            for obj in self._fsdp_objects()
            for name, value in vars(obj).items()
            if isinstance(value, dist.ProcessGroup) and value is not self.group
        ]


def _is_fsdp_internal(value: Any) -> bool:
    """FSDP2's own classes (state, parameter groups, parameters, mesh infos), and dataclasses
    holding a group: followed by the handle walk. Modules, tensors and meshes are not."""
    module = type(value).__module__
    if module.startswith("torch.distributed.fsdp._fully_shard") and not isinstance(
        value, (nn.Module, torch.Tensor)
    ):
        return True
    return (
        is_dataclass(value)
        and not isinstance(value, type)
        and any(isinstance(getattr(value, f.name, None), dist.ProcessGroup) for f in fields(value))
    )


def full_parameter(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter's full value: FSDP2's dim-0 shards gathered (`rltrain.runtime.distributed.gather_rows`)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return tensor
    if tuple(tensor.placements) != (Shard(0),):
        return tensor.full_tensor()
    return gather_rows(tensor.to_local(), tensor.shape[0], tensor.device_mesh.get_group())
