"""Atomic checkpoints and `trainer.resume=auto`.

A checkpoint is written into `checkpoints/step_N.tmp/` by every rank (engine state through
torch.distributed.checkpoint, each rank's CPU and CUDA RNG states as safetensors), then rank 0 writes
`trainer_state.json` (step, algorithm state such as the data position) and renames the directory
to `checkpoints/step_N/`. A directory without the `.tmp` suffix is therefore always complete; a
run killed mid-save leaves only a `.tmp` directory, which is ignored and cleaned up later.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rltrain.distributed import DistInfo, barrier, broadcast_str

STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointManager:
    def __init__(self, run_dir: Path, dist_info: DistInfo, keep: int) -> None:
        self.root = run_dir / "checkpoints"
        self.dist = dist_info
        self.keep = keep

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        if not self.root.exists():
            return []
        found = []
        for path in self.root.iterdir():
            m = STEP_DIR.match(path.name)
            if m and (path / "trainer_state.json").exists():
                found.append((int(m.group(1)), path))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, decided by rank 0 and shared with every rank."""
        choice = ""
        if self.dist.is_main:
            done = self.complete_checkpoints()
            choice = str(done[-1][1]) if done else ""
        choice = broadcast_str(choice)
        return Path(choice) if choice else None

    def save(self, step: int, engines: dict[str, Any], trainer_state: dict[str, Any]) -> Path:
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        for name, engine in engines.items():
            (tmp / name).mkdir(exist_ok=True)
            engine.save_checkpoint(tmp / name)
        rng_dir = tmp / "rng"
        rng_dir.mkdir(exist_ok=True)
        save_file(rng_states(), str(rng_dir / f"rank{self.dist.rank}.safetensors"))
        barrier()
        if self.dist.is_main:
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **trainer_state}, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            self._prune()
        barrier()
        return final

    def _prune(self) -> None:
        done = self.complete_checkpoints()
        for _, path in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(path, ignore_errors=True)
        for stale in self.root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)

    def load(self, path: Path, engines: dict[str, Any]) -> dict[str, Any]:
        for name, engine in engines.items():
            engine.load_checkpoint(path / name)
        rng_file = path / "rng" / f"rank{self.dist.rank}.safetensors"
        if rng_file.exists():
            restore_rng_states(load_file(str(rng_file)))
        return json.loads((path / "trainer_state.json").read_text())


def rng_states() -> dict[str, torch.Tensor]:
    """This rank's RNG states: torch's CPU generator and, on CUDA, the current device's."""
    states = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch_cuda"] = torch.cuda.get_rng_state()
    return states


def restore_rng_states(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["torch_cpu"])
    if "torch_cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["torch_cuda"])
