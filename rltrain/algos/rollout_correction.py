"""Rollout correction: what to do when the rollout engine's sampling distribution is not exactly
the trainer's (pure torch functions).

The engine samples with its own kernels and often a lower precision, so the policy gradient is
slightly off-policy; with `placement.max_staleness` >= 1 it is off-policy by up to k policy versions
(decoupled PPO: the clip is against the trainer's proximal log-probabilities, these weights correct
the behaviour gap). `algo.rollout_correction` bounds, reweights or drops what is too far off, per
token or per sequence: `tis`, `mask`, `seq_tis`, `seq_mask`, `geo_mask`, `icepop` (each one's
formula and source: docs/internals/algos.md; when to turn one on: docs/algorithms.md, docs/async.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rltrain.data.ragged import Ragged

MODES: tuple[str, ...] = ("none", "tis", "mask", "seq_tis", "seq_mask", "geo_mask", "icepop")


@dataclass(frozen=True)
class CorrectionBands:
    """The bounds of the newer modes (`tis` and `mask` take theirs as arguments of `correction`):
    `seq_mask` keeps a sequence whose ratio is in [is_floor, is_cap]; `geo_mask` one whose
    geometric-mean ratio is in [geo_low, geo_high]; `icepop` a token whose ratio is in
    [icepop_low, icepop_high]. The defaults are the papers' (docs/internals/algos.md)."""

    is_floor: float = 0.0
    geo_low: float = 0.999
    geo_high: float = 1.001
    icepop_low: float = 0.5
    icepop_high: float = 5.0


def resolve_mode(mode: str, max_staleness: int) -> str:
    """`auto` is `none` for a synchronous run (the samples are the trainer's own policy, up to the
    engine's numerics) and `tis` for an asynchronous one (up to k versions behind): docs/async.md."""
    if mode == "auto":
        return "tis" if max_staleness >= 1 else "none"
    return mode


def log_ratios(old_logps: Ragged, engine_logps: Ragged, sampled: Ragged | None = None) -> torch.Tensor:
    """[N] log(pi_old / pi_rollout) per completion token, detached; 0 on an environment's
    observation tokens (the engine sampled none of them)."""
    log_ratio_N = old_logps.values.detach().float() - engine_logps.values.float().to(old_logps.values.device)
    if sampled is not None:
        log_ratio_N = log_ratio_N * sampled.values.to(log_ratio_N.device, log_ratio_N.dtype)
    return log_ratio_N


def _sampled_counts(layout: Ragged, sampled: Ragged | None) -> torch.Tensor:
    """[B] sampled tokens per sequence (at least 1, so an empty sequence's mean is 0)."""
    if sampled is None:
        return layout.lengths().to(layout.values.device, torch.float32).clamp(min=1.0)
    return sampled.with_values(sampled.values.float()).sum_per_seq().to(layout.values.device).clamp(min=1.0)


def _check_bounds(mode: str, is_cap: float, mask_band: float, bands: CorrectionBands) -> None:
    if mode in ("tis", "seq_tis", "seq_mask") and is_cap <= 0:
        raise ValueError(f"algo.rollout_is_cap={is_cap} must be > 0")
    if mode == "mask" and mask_band < 1.0:
        raise ValueError(f"algo.rollout_mask_band={mask_band} must be >= 1 (the band is [1/band, band])")
    if mode == "seq_mask" and not 0 <= bands.is_floor < is_cap:
        raise ValueError(f"algo.rollout_is_floor={bands.is_floor} must be in [0, algo.rollout_is_cap={is_cap})")
    if mode == "geo_mask" and not 0 < bands.geo_low <= 1 <= bands.geo_high:
        raise ValueError(f"algo.rollout_geo_band=[{bands.geo_low}, {bands.geo_high}] must hold 1 (0 < low <= 1 <= high)")
    if mode == "icepop" and not 0 < bands.icepop_low <= 1 <= bands.icepop_high:
        raise ValueError(f"algo.rollout_icepop_band=[{bands.icepop_low}, {bands.icepop_high}] must hold 1 (0 < low <= 1 <= high)")


def correction(
    old_logps: Ragged, engine_logps: Ragged, mode: str, is_cap: float, mask_band: float, sampled: Ragged | None = None,
    bands: CorrectionBands | None = None,
) -> tuple[Ragged | None, torch.Tensor | None]:
    """(per-token weights or None, [B] bool keep mask or None) for `mode` (docs/internals/algos.md).
    With `sampled` (multi-turn) only the policy's tokens count: an observation has no engine
    log-probability, its weight is 1 and it is left out of a sequence's sum and mean."""
    if mode not in MODES:
        raise ValueError(f"algo.rollout_correction={mode!r}: choose one of {', '.join(MODES)}")
    bands = bands or CorrectionBands()
    _check_bounds(mode, is_cap, mask_band, bands)
    if mode == "none":
        return None, None
    log_ratio_N = log_ratios(old_logps, engine_logps, sampled)
    if mode == "tis":
        return old_logps.with_values(torch.exp(log_ratio_N).clamp(max=is_cap)), None
    if mode == "icepop":
        ratio_N = torch.exp(log_ratio_N)
        inside_N = (ratio_N >= bands.icepop_low) & (ratio_N <= bands.icepop_high)
        return old_logps.with_values(torch.where(inside_N, ratio_N, torch.zeros_like(ratio_N))), None
    per_seq = old_logps.with_values(log_ratio_N)
    if mode in ("mask", "geo_mask"):
        mean_log_ratio_B = per_seq.sum_per_seq() / _sampled_counts(per_seq, sampled)
        if mode == "mask":
            return None, mean_log_ratio_B.abs() <= math.log(mask_band)
        geo_B = torch.exp(mean_log_ratio_B)
        return None, (geo_B >= bands.geo_low) & (geo_B <= bands.geo_high)
    seq_ratio_B = torch.exp(per_seq.sum_per_seq())
    if mode == "seq_tis":
        return per_seq.broadcast(seq_ratio_B.clamp(max=is_cap)), None
    keep_B = (seq_ratio_B >= bands.is_floor) & (seq_ratio_B <= is_cap)
    return per_seq.broadcast(torch.where(keep_B, seq_ratio_B, torch.zeros_like(seq_ratio_B))), keep_B


def correction_metrics(
    weights: Ragged | None, keep_B: torch.Tensor | None, num_tokens: int, global_tokens: float, global_seqs: float,
    sampled: Ragged | None = None,
) -> dict[str, float | torch.Tensor]:
    """This micro-batch's share of `rollout/is_weight_mean`, `rollout/masked_frac` (sequences) and
    `rollout/masked_token_frac` (sampled tokens whose weight is 0: icepop, seq_mask), over the
    sampled tokens: `num_tokens` counts them."""
    if weights is None:
        weight_sum: float | torch.Tensor = float(num_tokens)
        zero_tokens: float | torch.Tensor = 0.0
    else:
        w_N = weights.values.detach()
        counted_N = torch.ones_like(w_N) if sampled is None else sampled.values.to(w_N.device, w_N.dtype)
        weight_sum = (w_N * counted_N).sum()
        zero_tokens = ((w_N == 0).to(w_N.dtype) * counted_N).sum()
    masked = (~keep_B).float().sum() if keep_B is not None else 0.0
    return {
        "rollout/is_weight_mean": weight_sum / max(global_tokens, 1.0),
        "rollout/masked_frac": masked / max(global_seqs, 1.0),
        "rollout/masked_token_frac": zero_tokens / max(global_tokens, 1.0),
    }


# The largest |log ratio| the mismatch metrics read: an engine log-probability at its floor (vLLM
# reports -9999 for a token it gives no probability) would make exp(log ratio) infinite, and one
# token would turn `rollout/mismatch_kl` and `rollout/is_ratio_max` into inf. e^20 = 4.9e8 says
# "far off" as clearly; `rollout/clamped_tokens` counts the tokens past it.
METRIC_LOG_RATIO_BOUND = 20.0


def metric_log_ratios(old_logps: Ragged, engine_logps: Ragged, sampled: Ragged | None = None) -> torch.Tensor:
    """[N] `log_ratios` in float64, clamped to +-METRIC_LOG_RATIO_BOUND: what the metrics read.
    float64 so that a k3 of a 1e-6 log ratio (5e-13) is not rounded away."""
    log_ratio_N = old_logps.values.detach().double() - engine_logps.values.double().to(old_logps.values.device)
    if sampled is not None:
        log_ratio_N = log_ratio_N * sampled.values.to(log_ratio_N.device, log_ratio_N.dtype)
    bound = METRIC_LOG_RATIO_BOUND  # a NaN counts as far off too (`clamped_tokens`)
    return torch.nan_to_num(log_ratio_N, nan=bound, posinf=bound, neginf=-bound).clamp(-bound, bound)


def clamped_tokens(old_logps: Ragged, engine_logps: Ragged, sampled: Ragged | None = None) -> torch.Tensor:
    """How many sampled tokens' log ratio the metrics clamp (|log ratio| > METRIC_LOG_RATIO_BOUND,
    or not a number): `rollout/clamped_tokens`, summed over micro-batches and ranks."""
    log_ratio_N = old_logps.values.detach().double() - engine_logps.values.double().to(old_logps.values.device)
    past_N = ~(log_ratio_N.abs() <= METRIC_LOG_RATIO_BOUND)
    if sampled is not None:
        past_N = past_N & sampled.values.to(past_N.device).bool()
    return past_N.sum().double()


def mismatch_kl_sum(old_logps: Ragged, engine_logps: Ragged, sampled: Ragged | None = None) -> torch.Tensor:
    """The sum over sampled tokens of the k3 estimate of KL(pi_rollout || pi_old):
    `rho - 1 - log rho` with `rho = pi_old / pi_rollout`, non-negative per token and unbiased under
    the rollout's samples (an observation's rho is 1: 0). Divided by the global token count it is
    `rollout/mismatch_kl`. As `expm1(x) - x` in float64 on the clamped log ratios: `exp(x) - 1 - x`
    in float32 reads 0 below |x| = 1e-4, where fp32 engines' mismatches are."""
    log_ratio_N = metric_log_ratios(old_logps, engine_logps, sampled)
    return (torch.expm1(log_ratio_N) - log_ratio_N).sum()


def ratio_max(old_logps: Ragged, engine_logps: Ragged, mode: str, sampled: Ragged | None = None) -> torch.Tensor:
    """The largest importance ratio the mode looks at, before truncation or masking: a sequence's
    (`seq_tis`, `seq_mask`), a sequence's geometric mean (`mask`, `geo_mask`) or a token's (the
    others); 0 with no tokens. From the clamped log ratios, and a sequence's sum is clamped too, so
    it is at most e^METRIC_LOG_RATIO_BOUND. A 0-dim tensor where the log-probabilities are: the loss
    calls this per micro-batch, and the step reads the running maximum once (`ParityProbe`), so no
    micro-batch waits on the device. `rollout/is_ratio_max` is its maximum over the step's ranks."""
    if old_logps.num_tokens == 0:
        return torch.zeros((), dtype=torch.float64, device=old_logps.values.device)
    log_ratio_N = metric_log_ratios(old_logps, engine_logps, sampled)
    per_seq = old_logps.with_values(log_ratio_N)
    if mode in ("seq_tis", "seq_mask"):
        return torch.exp(per_seq.sum_per_seq().clamp(max=METRIC_LOG_RATIO_BOUND)).max()
    if mode in ("mask", "geo_mask"):
        return torch.exp(per_seq.sum_per_seq() / _sampled_counts(per_seq, sampled)).max()
    if sampled is not None:
        log_ratio_N = log_ratio_N.masked_fill(~sampled.values.to(log_ratio_N.device).bool(), -math.inf)
    return torch.exp(log_ratio_N.max())
