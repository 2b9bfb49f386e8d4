"""Atomic checkpoints and `trainer.resume=auto`.

Every rank writes into `checkpoints/step_N.tmp/` and rank 0 renames it when complete, so a run
killed mid-save never leaves a directory that looks whole. Each checkpoint lists its files with
sizes and CRC-32s and a fingerprint of what must match to resume, so a corrupt or foreign one is
skipped or refused instead of loaded. How: docs/internals/run.md; the files: docs/run-directory.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import zlib
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from rltrain.config.hub import model_identity
from rltrain.config.schema import Config
from rltrain.runtime.distributed import DistInfo, barrier, broadcast_str
from rltrain.runtime.errors import UserError

STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's data and metadata to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, obj: Any) -> None:
    """Write JSON and fsync the file (its directory is fsynced by the caller's rename)."""
    with open(path, "w") as f:
        f.write(json.dumps(obj, indent=1))
        f.flush()
        os.fsync(f.fileno())


def file_digest(path: Path, chunk: int = 1 << 22) -> dict[str, int]:
    """Size and CRC-32 of a file; the file is fsynced on the way (the same open)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
            size += len(block)
        os.fsync(f.fileno())
    return {"size": size, "crc32": crc}


def manifest(directory: Path) -> dict[str, dict[str, int]]:
    """Every file under `directory` (but trainer_state.json) with its size and CRC-32."""
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != STATE_FILE:
            out[path.relative_to(directory).as_posix()] = file_digest(path)
    return out


def check_checkpoint(path: Path) -> tuple[dict[str, Any] | None, str]:
    """(trainer state, "") for a complete checkpoint, (None, what is wrong) for a torn or corrupt one.
    A checkpoint written before files were recorded is trusted as it is."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError("no step recorded")
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return None, f"{STATE_FILE} is unreadable ({type(exc).__name__}: {exc})"
    for rel, want in (state.get("files") or {}).items():
        f = path / rel
        if not f.is_file():
            return None, f"{rel} is missing"
        size = f.stat().st_size
        if size != want["size"]:
            return None, f"{rel} has {size} bytes, {want['size']} were written"
        if file_digest(f)["crc32"] != want["crc32"]:
            return None, f"{rel} does not match the checksum written with it"
    return state, ""


def _config_identity(model_dir: Path) -> tuple[str, str]:
    """(architecture, short hash) of a model directory's config.json, without the fields that name
    where or with which library version it was written."""
    try:
        hf = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "unknown", "unknown"
    arch = ",".join(hf.get("architectures") or [hf.get("model_type", "unknown")])
    for key in ("transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        hf.pop(key, None)
    return arch, hashlib.sha256(json.dumps(hf, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint(cfg: Config, model_dir: Path, world_size: int) -> dict[str, Any]:
    """What must be the same for a checkpoint to resume this run: the model (its path, or the
    built-in tiny model, and its architecture and config.json), the world layout (ranks, backend,
    megatron's tp/pp), the algorithm, and the frozen roles a checkpoint does not hold (the
    reference and the reward model are read from their paths at start-up, so another path would
    silently change the KL or the reward of the resumed steps), and the LoRA adapters' shape. An
    unset role path is recorded as None, which a checkpoint written before roles were recorded also
    reads as."""
    arch, config_hash = _config_identity(model_dir)
    layout = {"world_size": world_size, "backend": cfg.backend.name}
    if cfg.backend.name == "megatron":
        layout.update(tp=cfg.backend.tp, pp=cfg.backend.pp)
    model = "built-in tiny model" if cfg.model.path is None else model_identity(cfg.model.path, cfg.model.revision)
    return {
        "model": model,
        "architecture": arch,
        "model_config": config_hash,
        **layout,
        "algorithm": cfg.algo.name,
        "reference": _role_path(cfg, "reference"),
        "reward_model": _role_path(cfg, "reward_model"),
        "lora": _lora_identity(cfg),
        # A checkpoint generating ahead holds batches in flight; a synchronous one none (recorded as None).
        "max_staleness": OmegaConf.select(cfg, "placement.max_staleness") or None,
    }


def _lora_identity(cfg: Config) -> str | None:
    """The adapters' shape (None for full fine-tuning, which a checkpoint written before LoRA
    existed also reads as): another rank or set of targets cannot load the saved adapters."""
    lora = cfg.model.lora
    if lora.rank == 0:
        return None
    return f"rank {lora.rank}, alpha {lora.alpha}, target_modules {','.join(sorted(lora.target_modules))}"


def _role_path(cfg: Config, role: str) -> str | None:
    path = OmegaConf.select(cfg, f"{role}.path")
    return None if path is None else model_identity(path, OmegaConf.select(cfg, f"{role}.revision"))


def fingerprint_mismatch(saved: dict[str, Any] | None, current: dict[str, Any], path: Path) -> str:
    """"" when the checkpoint may resume this run, else the error message naming each difference."""
    if not saved:
        return ""  # a checkpoint without a fingerprint: nothing to compare
    diffs = [
        f"{key}: checkpoint {saved.get(key)!r}, this run {current.get(key)!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]
    if not diffs:
        return ""
    return (
        f"the checkpoint {path} was written by a different run ({'; '.join(diffs)}), so this run cannot "
        "resume from it. Run with the settings it was written with, start from scratch in this directory "
        "with trainer.resume=never (its checkpoints are replaced as the new run saves), or use a fresh "
        "hydra.run.dir."
    )


class CheckpointManager:
    def __init__(self, run_dir: Path, dist_info: DistInfo, keep: int, fingerprint: dict[str, Any] | None = None) -> None:
        self.root = run_dir / "checkpoints"
        self.dist = dist_info
        self.keep = max(1, keep)  # never the checkpoint just written (validate.py rejects keep < 1)
        self.fingerprint = fingerprint or {}

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        if not self.root.exists():
            return []
        found = []
        for path in self.root.iterdir():
            m = STEP_DIR.match(path.name)
            if m and (path / STATE_FILE).exists():
                found.append((int(m.group(1)), path))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, decided by rank 0 and shared with every rank. Torn or
        corrupt ones are reported and moved aside; a foreign one (another fingerprint) raises a
        UserError on every rank."""
        choice = {"path": "", "error": ""}
        if self.dist.is_main:
            try:
                choice = self._choose()
            except OSError as exc:  # every rank waits for this choice: answer it, never leave them
                choice = {"path": "", "error": f"cannot read the checkpoints in {self.root}: {exc}"}
        choice = json.loads(broadcast_str(json.dumps(choice)))
        if choice["error"]:
            raise UserError(choice["error"])
        return Path(choice["path"]) if choice["path"] else None

    def _choose(self) -> dict[str, str]:
        for _, path in reversed(self.complete_checkpoints()):
            state, problem = check_checkpoint(path)
            if state is None:
                aside = path.with_name(path.name + ".corrupt")
                shutil.rmtree(aside, ignore_errors=True)
                try:
                    path.rename(aside)
                    moved = f"moved aside to {aside.name}"
                except OSError:
                    moved = "left in place"
                print(
                    f"rltrain: warning: checkpoint {path} is torn or corrupt ({problem}); {moved}, "
                    "trying the previous one.",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            return {"path": str(path), "error": fingerprint_mismatch(state.get("fingerprint"), self.fingerprint, path)}
        return {"path": "", "error": ""}

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
            files = manifest(tmp)  # also fsyncs every file
            state = {"step": step, **trainer_state, "fingerprint": self.fingerprint, "files": files}
            write_json_durably(tmp / STATE_FILE, state)
            for sub in sorted({p.parent for p in tmp.rglob("*") if p.is_file()}, key=lambda p: len(p.parts), reverse=True):
                fsync_path(sub)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            fsync_path(self.root)
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
        return json.loads((path / STATE_FILE).read_text())


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
