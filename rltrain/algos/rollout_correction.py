"""Rollout correction: what to do when the rollout engine's sampling distribution is not exactly
the trainer's (pure torch functions).

The engine samples with its own kernels and often a lower precision, so the policy gradient is
slightly off-policy; with `placement.max_staleness` >= 1 it is off-policy by up to k policy versions
(decoupled PPO: the clip is against the trainer's proximal log-probabilities, these weights correct
the behaviour gap). `algo.rollout_correction` (`auto`, `none`, `tis`, `mask`) bounds or drops what is
too far off. Definitions and metrics: docs/internals/algos.md; when to turn it on: docs/algorithms.md,
docs/async.md.
"""

from __future__ import annotations

import math

import torch

from rltrain.data.ragged import Ragged

MODES: tuple[str, ...] = ("none", "tis", "mask")


def resolve_mode(mode: str, max_staleness: int) -> str:
    """`auto` is `none` for a synchronous run (the samples are the trainer's own policy, up to the
    engine's numerics) and `tis` for an asynchronous one (up to k versions behind): docs/async.md."""
    if mode == "auto":
        return "tis" if max_staleness >= 1 else "none"
    return mode


def correction(
    old_logps: Ragged, engine_logps: Ragged, mode: str, is_cap: float, mask_band: float, sampled: Ragged | None = None
) -> tuple[Ragged | None, torch.Tensor | None]:
    """(per-token weights or None, [B] bool keep mask or None) for `mode` (docs/internals/algos.md).
    With `sampled` (multi-turn) only the policy's tokens count: an observation has no engine
    log-probability, its weight is 1 and it is left out of a sequence's mean."""
    if mode not in MODES:
        raise ValueError(f"algo.rollout_correction={mode!r}: choose one of {', '.join(MODES)}")
    if mode == "none":
        return None, None
    log_ratio_N = old_logps.values.detach().float() - engine_logps.values.float().to(old_logps.values.device)
    if sampled is not None:
        log_ratio_N = log_ratio_N * sampled.values.to(log_ratio_N.device, log_ratio_N.dtype)
    if mode == "tis":
        if is_cap <= 0:
            raise ValueError(f"algo.rollout_is_cap={is_cap} must be > 0")
        return old_logps.with_values(torch.exp(log_ratio_N).clamp(max=is_cap)), None
    if mask_band < 1.0:
        raise ValueError(f"algo.rollout_mask_band={mask_band} must be >= 1 (the band is [1/band, band])")
    if sampled is None:
        mean_log_ratio_B = old_logps.with_values(log_ratio_N).mean_per_seq()
    else:
        counts_B = sampled.with_values(sampled.values.float()).sum_per_seq().to(log_ratio_N.device).clamp(min=1.0)
        mean_log_ratio_B = old_logps.with_values(log_ratio_N).sum_per_seq() / counts_B
    return None, mean_log_ratio_B.abs() <= math.log(mask_band)


def correction_metrics(
    weights: Ragged | None, keep_B: torch.Tensor | None, num_tokens: int, global_tokens: float, global_seqs: float,
    sampled: Ragged | None = None,
) -> dict[str, float | torch.Tensor]:
    """This micro-batch's share of `rollout/is_weight_mean` and `rollout/masked_frac` (over the
    sampled tokens: `num_tokens` counts them)."""
    if weights is None:
        weight_sum: float | torch.Tensor = float(num_tokens)
    elif sampled is None:
        weight_sum = weights.values.detach().sum()
    else:
        weight_sum = (weights.values.detach() * sampled.values.to(weights.values.device, weights.values.dtype)).sum()
    masked = (~keep_B).float().sum() if keep_B is not None else 0.0
    return {
        "rollout/is_weight_mean": weight_sum / max(global_tokens, 1.0),
        "rollout/masked_frac": masked / max(global_seqs, 1.0),
    }
