"""What a rank's algorithm and engines are given to run: the composed config, typed by the root
`Config` (an OmegaConf node at run time; the annotation is for the type checker), and what the
rank resolved around it (run directory, process group, model directories, tokenizer) and the
objects the run holds for its engines (its fault injector, what its engines share). It lives here,
low, because the trainer, the backends and the rollout engines all read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from rltrain.config.schema import Config
from rltrain.runtime.distributed import DistInfo
from rltrain.safety.faults import FaultInjector

T = TypeVar("T")


class SharedObjects:
    """Objects the engines of one run share, one of each type, created by the first engine that asks
    (megatron's parallel groups: megatron keeps its parallel state per process, so a policy and its
    reference join one record of it). They end with the run that holds them."""

    def __init__(self) -> None:
        self._objects: dict[type, object] = {}

    def one(self, cls: type[T], create: Callable[[], T]) -> T:
        if cls not in self._objects:
            self._objects[cls] = create()
        return cast(T, self._objects[cls])


@dataclass
class RunContext:
    cfg: Config
    run_dir: Path
    dist: DistInfo
    model_dir: Path  # the policy's initial weights
    tokenizer: Any
    # Where each other role's model comes from ("reference", "critic"); a role not listed starts
    # from the policy's initial weights (`model_dir`).
    role_dirs: dict[str, Path] = field(default_factory=dict)
    # `debug.fault`'s faults meant for this rank; the loop sets its step, the engines inject.
    faults: FaultInjector = field(default_factory=FaultInjector)
    shared: SharedObjects = field(default_factory=SharedObjects)

    def model_dir_for(self, role: str) -> Path:
        return self.role_dirs.get(role, self.model_dir)
