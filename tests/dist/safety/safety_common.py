"""Shared pieces of the safety tests: a tiny model directory, per-rank batches, an engine."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 40


def tiny_model_dir() -> Path:
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    return build_tiny_model_dir(cfg, seed=3)


def rank_batch(rank: int, step: int, n: int = 2):
    """Different data per rank and step; also returns the global completion-token count."""
    from rltrain.data.batch import SequenceBatch

    def seqs(r: int):
        g = torch.Generator().manual_seed(1000 * step + r)
        prompts = [torch.randint(4, VOCAB, (3 + i,), generator=g).tolist() for i in range(n)]
        comps = [torch.randint(4, VOCAB, (2 + i + r,), generator=g).tolist() for i in range(n)]
        return prompts, comps

    total = sum(len(c) for r in range(2) for c in seqs(r)[1])
    prompts, comps = seqs(rank)
    return SequenceBatch.from_lists(prompts, comps, global_tokens=total), total


def empty_batch(global_tokens: int):
    from rltrain.data.batch import SequenceBatch

    return SequenceBatch.from_lists([], [], global_tokens=global_tokens)


def make_engine(model_dir: Path, fail_fast: bool = False, max_consecutive_errors: int = 3, faults=None):
    from rltrain.backends.fsdp.engine import FSDPEngine
    from rltrain.config.group_options import FSDPBackendConfig
    from rltrain.config.schema import OptimConfig, SafetyConfig

    optim = OptimConfig(lr=1e-2, warmup_steps=8, schedule="constant")  # warm-up: the LR moves every step
    safety = SafetyConfig(fail_fast=fail_fast, max_consecutive_errors=max_consecutive_errors)
    return FSDPEngine(model_dir, FSDPBackendConfig(), optim, 10, torch.device("cpu"), safety=safety, faults=faults)


def full_params(engine) -> dict[str, torch.Tensor]:
    """Unsharded parameters (a collective: every rank calls it)."""
    return {k: v.clone() for k, v in engine.export_weights()}


def adam_steps(engine) -> list[float]:
    return [float(s["step"]) for s in engine.optimizer.state.values() if "step" in s]
