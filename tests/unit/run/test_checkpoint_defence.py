"""Checkpoints defend themselves: file manifest, torn/corrupt detection, fingerprint comparison."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from rltrain.run.checkpoint import (
    check_checkpoint,
    fingerprint,
    fingerprint_mismatch,
    manifest,
    write_json_durably,
)


def _checkpoint(root: Path) -> Path:
    path = root / "step_00000002"
    (path / "policy" / "engine").mkdir(parents=True)
    (path / "policy" / "engine" / "__0_0.distcp").write_bytes(b"x" * 1000)
    (path / "policy" / "engine_state.json").write_text('{"steps_taken": 2}')
    write_json_durably(path / "trainer_state.json", {"step": 2, "files": manifest(path)})
    return path


def test_a_complete_checkpoint_passes(tmp_path):
    state, problem = check_checkpoint(_checkpoint(tmp_path))
    assert problem == "" and state["step"] == 2
    assert set(state["files"]) == {"policy/engine/__0_0.distcp", "policy/engine_state.json"}


def test_truncated_overwritten_missing_and_unreadable_files_are_named(tmp_path):
    path = _checkpoint(tmp_path / "a")
    (path / "policy" / "engine" / "__0_0.distcp").write_bytes(b"x" * 10)
    assert "policy/engine/__0_0.distcp has 10 bytes, 1000 were written" in check_checkpoint(path)[1]

    path = _checkpoint(tmp_path / "b")
    (path / "policy" / "engine" / "__0_0.distcp").write_bytes(b"y" * 1000)
    assert "does not match the checksum" in check_checkpoint(path)[1]

    path = _checkpoint(tmp_path / "c")
    (path / "policy" / "engine_state.json").unlink()
    assert check_checkpoint(path) == (None, "policy/engine_state.json is missing")

    path = _checkpoint(tmp_path / "d")
    (path / "trainer_state.json").write_text('{"step": 2, "fil')
    state, problem = check_checkpoint(path)
    assert state is None and "trainer_state.json is unreadable" in problem


def test_fingerprint_names_every_difference_and_the_fix(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 8}))
    cfg = OmegaConf.create({"model": {"path": None, "lora": {"rank": 0}}, "backend": {"name": "fsdp"}, "algo": {"name": "sft"}})
    saved = fingerprint(cfg, tmp_path, world_size=1)
    assert saved["architecture"] == "Qwen2ForCausalLM" and saved["world_size"] == 1
    assert fingerprint_mismatch(saved, fingerprint(cfg, tmp_path, 1), tmp_path) == ""
    assert fingerprint_mismatch(None, saved, tmp_path) == ""  # a checkpoint from before fingerprints

    cfg.algo.name = "dpo"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 16}))
    message = fingerprint_mismatch(saved, fingerprint(cfg, tmp_path, 2), tmp_path / "step_1")
    assert "world_size: checkpoint 1, this run 2" in message
    assert "algorithm: checkpoint 'sft', this run 'dpo'" in message
    assert "model_config" in message and "hidden_size" not in message
    assert "trainer.resume=never" in message and "hydra.run.dir" in message


def test_fingerprint_covers_the_frozen_roles_a_checkpoint_does_not_hold(tmp_path):
    """The reference and the reward model are read from their paths, not from the checkpoint: a
    resume with another one must be refused, while unset paths match older checkpoints."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    cfg = OmegaConf.create({
        "model": {"path": None, "lora": {"rank": 0}}, "backend": {"name": "fsdp"}, "algo": {"name": "grpo"},
        "reference": {"path": None}, "reward_model": {"path": None},
    })
    saved = fingerprint(cfg, tmp_path, world_size=1)
    assert saved["reference"] is None and saved["reward_model"] is None
    older = {k: v for k, v in saved.items() if k not in ("reference", "reward_model")}
    assert fingerprint_mismatch(older, saved, tmp_path) == ""

    cfg.reference.path = str(tmp_path / "ref")
    cfg.reward_model.path = str(tmp_path / "rm")
    message = fingerprint_mismatch(saved, fingerprint(cfg, tmp_path, 1), tmp_path / "step_1")
    assert f"reference: checkpoint None, this run {str(tmp_path / 'ref')!r}" in message
    assert f"reward_model: checkpoint None, this run {str(tmp_path / 'rm')!r}" in message


def test_fingerprint_refuses_adapters_of_another_shape_and_full_fine_tuning_checkpoints(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    lora = {"rank": 8, "alpha": 16, "target_modules": ["all-linear"]}
    cfg = OmegaConf.create({"model": {"path": None, "lora": lora}, "backend": {"name": "fsdp"}, "algo": {"name": "sft"}})
    saved = fingerprint(cfg, tmp_path, world_size=1)
    assert saved["lora"] == "rank 8, alpha 16, target_modules all-linear"
    cfg.model.lora.rank = 16
    message = fingerprint_mismatch(saved, fingerprint(cfg, tmp_path, 1), tmp_path / "step_1")
    assert "lora: checkpoint 'rank 8, alpha 16, target_modules all-linear', this run 'rank 16" in message
    cfg.model.lora.rank = 0  # full fine-tuning cannot resume from adapters, nor the other way round
    full = fingerprint(cfg, tmp_path, 1)
    assert full["lora"] is None and "lora: checkpoint 'rank 8" in fingerprint_mismatch(saved, full, tmp_path)
    older = {k: v for k, v in full.items() if k != "lora"}  # written before LoRA existed
    assert fingerprint_mismatch(older, full, tmp_path) == ""


class _Engine:
    def save_checkpoint(self, directory: Path) -> None:
        (directory / "weights.bin").write_bytes(b"w" * 64)


def test_save_fsyncs_every_file_the_directories_and_the_rename_and_keeps_the_newest(tmp_path, monkeypatch):
    import os

    import torch

    from rltrain.run import checkpoint
    from rltrain.runtime.distributed import DistInfo

    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(checkpoint.os, "fsync", recording_fsync)
    manager = checkpoint.CheckpointManager(
        tmp_path, DistInfo(0, 1, 0, torch.device("cpu")), keep=0, fingerprint={"algorithm": "sft"}
    )
    assert manager.keep == 1  # never deletes the checkpoint just written (validate.py refuses 0)
    for step in (1, 2):
        final = manager.save(step, {"policy": _Engine()}, {"algorithm": {}})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002"]
    tmp = str(tmp_path / "checkpoints" / "step_00000002.tmp")
    for name in ("policy/weights.bin", "rng/rank0.safetensors", "trainer_state.json", "policy", "rng", ""):
        assert os.path.join(tmp, name).rstrip("/") in synced, name
    assert str(tmp_path / "checkpoints") in synced  # the rename
    state, problem = checkpoint.check_checkpoint(final)
    assert problem == "" and state["fingerprint"] == {"algorithm": "sft"} and "policy/weights.bin" in state["files"]
