"""What a rank's algorithm and engines are given to run: the composed config, typed by the root
`Config` (an OmegaConf node at run time; the annotation is for the type checker), and what the
rank resolved around it (run directory, process group, model directories, tokenizer) and the
objects the run holds for its engines (its fault injector). It lives here, low, because the
trainer, the backends and the rollout engines all read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rltrain.config.schema import Config
from rltrain.runtime.distributed import DistInfo
from rltrain.safety.faults import FaultInjector


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

    def model_dir_for(self, role: str) -> Path:
        return self.role_dirs.get(role, self.model_dir)
