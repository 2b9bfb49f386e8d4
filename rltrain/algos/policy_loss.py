"""The policy loss every RL algorithm shares (GRPO, PPO, distillation), as pure torch functions: an
importance ratio from `IMPORTANCE_RATIOS` (per token, or GSPO's per sequence), a surrogate from
`SURROGATES` (PPO's clip, CISPO's clipped weight, GSPO's clip on the sequence ratio), the k3 KL to the reference, and the aggregation
of per-token values into a loss already divided by a *global* count, so micro-batch size,
accumulation and the rank count do not change it. docs/internals/algos.md says what each computes
and its sources; adding a surrogate: docs/adding-an-algorithm.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import get_args

import torch

from rltrain.algos.rl.config import LossAgg
from rltrain.data.ragged import Ragged

LOSS_AGGS: tuple[str, ...] = get_args(LossAgg)


@dataclass(frozen=True)
class PolicyLossInputs:
    """Everything `policy_loss` reads. `logps` (differentiable), `old_logps`, `ref_logps`,
    `entropy` and `is_weights` are ragged over the same completion tokens; `adv` is a [B] tensor (one
    advantage per sequence) or a Ragged (one per token); `keep_B` (bool) drops sequences from the
    surrogate. `old_logps=None` means on-policy (`logps.detach()`). `global_tokens` / `global_seqs`
    count completion tokens / sequences over every micro-batch and rank of the optimizer step;
    `max_len` is Dr. GRPO's constant. `sampled` (bool per token, multi-turn trajectories) keeps the
    tokens the policy sampled: observations get no gradient and count in no mean, and
    `global_tokens` then counts sampled tokens only. The settings are the `algo.*` keys of the same
    names (`kind` is `algo.policy_loss`, `max_len` `algo.max_new_tokens`)."""

    logps: Ragged
    adv: torch.Tensor | Ragged
    _: KW_ONLY
    global_tokens: float
    global_seqs: float
    old_logps: Ragged | None = None
    ref_logps: Ragged | None = None
    entropy: Ragged | None = None
    is_weights: Ragged | None = None
    keep_B: torch.Tensor | None = None
    sampled: Ragged | None = None
    kind: str = "clip"
    importance_level: str = "token"
    loss_agg: str = "token_mean"
    clip_low: float = 0.2
    clip_high: float = 0.28
    beta: float = 0.0
    max_len: int = 0


# --- the surrogates: one entry per `algo.policy_loss` ---------------------------------------------


@dataclass(frozen=True)
class SurrogateTerms:
    """What a surrogate reads, per completion token: the importance ratio (differentiable; the
    sequence's under GSPO), the differentiable log-probabilities, the advantages (detached) and
    the clip bounds."""

    ratio_N: torch.Tensor
    logps_N: torch.Tensor
    adv_N: torch.Tensor
    clip_low: float
    clip_high: float


# (per-token loss before masking and weighting, 1.0 where the clip changed the token's term)
Surrogate = Callable[[SurrogateTerms], tuple[torch.Tensor, torch.Tensor]]


def clipped_surrogate(t: SurrogateTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate: `max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`."""
    unclipped_N = -t.adv_N * t.ratio_N
    clipped_N = -t.adv_N * torch.clamp(t.ratio_N, 1.0 - t.clip_low, 1.0 + t.clip_high)
    return torch.maximum(unclipped_N, clipped_N), (clipped_N > unclipped_N).float()


def cispo_surrogate(t: SurrogateTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO: `-A * sg(min(r, 1 + clip_high)) * logp`. The weight is clipped and detached, so every
    token keeps a gradient."""
    weight_N = torch.clamp(t.ratio_N.detach(), max=1.0 + t.clip_high)
    return -t.adv_N * weight_N * t.logps_N, (t.ratio_N.detach() > 1.0 + t.clip_high).float()


@dataclass(frozen=True)
class SurrogateKind:
    """One `algo.policy_loss`: the importance ratio it is defined on (a key of `IMPORTANCE_RATIOS`)
    and its per-token loss."""

    ratio: str
    loss: Surrogate


# Keyed by `algo.policy_loss`, whose allowed values (`PolicyLossKind`) are these keys. `gspo` is
# PPO's clip on GSPO's sequence ratio; `algo.importance_level=sequence` puts any kind on it.
SURROGATES: dict[str, SurrogateKind] = {
    "clip": SurrogateKind("token", clipped_surrogate),
    "cispo": SurrogateKind("token", cispo_surrogate),
    "gspo": SurrogateKind("sequence", clipped_surrogate),
}
POLICY_LOSSES: tuple[str, ...] = tuple(SURROGATES)


# --- the importance ratio: one entry per `algo.importance_level` -----------------------------------
# (per-token log ratio log(pi / pi_old), differentiable through `logps`) of (logps, old_N, keep_N)
ImportanceRatio = Callable[[Ragged, torch.Tensor, torch.Tensor], torch.Tensor]


def token_log_ratio(logps: Ragged, old_N: torch.Tensor, keep_N: torch.Tensor) -> torch.Tensor:
    """PPO's ratio: each token's own."""
    return logps.values.float() - old_N


def sequence_log_ratio(logps: Ragged, old_N: torch.Tensor, keep_N: torch.Tensor) -> torch.Tensor:
    """GSPO's: every token carries its sequence's length-normalised log ratio (the mean over the
    sequence's counted tokens, `keep_N`), with the token's own gradient (GSPO-token: the value is
    the sequence's, the gradient flows through each log-probability), so a per-token advantage
    keeps its meaning and a per-sequence one gives GSPO's gradient exactly."""
    logps_N = logps.values.float()
    log_ratio_N = logps_N - old_N
    counted = logps.with_values(keep_N)
    seq_mean_B = logps.with_values(log_ratio_N.detach() * keep_N).sum_per_seq() / counted.sum_per_seq().clamp(min=1.0)
    return logps_N - logps_N.detach() + logps.broadcast(seq_mean_B).values


# Keyed by `algo.importance_level`, whose allowed values (`ImportanceLevel`) are these keys.
IMPORTANCE_RATIOS: dict[str, ImportanceRatio] = {"token": token_log_ratio, "sequence": sequence_log_ratio}
IMPORTANCE_LEVELS: tuple[str, ...] = tuple(IMPORTANCE_RATIOS)


def importance_log_ratio(
    logps: Ragged, old_N: torch.Tensor, keep_N: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """Per-token log importance ratio log(pi / pi_old) at `level` (`IMPORTANCE_RATIOS`)."""
    if level not in IMPORTANCE_RATIOS:
        raise ValueError(f"algo.importance_level={level!r}: choose one of {', '.join(IMPORTANCE_LEVELS)}")
    return IMPORTANCE_RATIOS[level](logps, old_N, keep_N)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): `exp(ref - logp) - (ref - logp) - 1` (>= 0)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


# --- the loss --------------------------------------------------------------------------------------


def check_policy_loss_inputs(x: PolicyLossInputs) -> None:
    """A ValueError naming what is inconsistent (the config's values are checked before a run)."""
    if x.kind not in SURROGATES:
        raise ValueError(f"algo.policy_loss={x.kind!r}: choose one of {', '.join(SURROGATES)}")
    if x.importance_level not in IMPORTANCE_RATIOS:
        raise ValueError(f"algo.importance_level={x.importance_level!r}: choose one of {', '.join(IMPORTANCE_LEVELS)}")
    if x.loss_agg not in LOSS_AGGS:
        raise ValueError(f"algo.loss_agg={x.loss_agg!r}: choose one of {', '.join(LOSS_AGGS)}")
    if not (0.0 <= x.clip_low < 1.0 and x.clip_high >= 0.0):
        raise ValueError(f"clip bounds need 0 <= clip_low < 1 and clip_high >= 0 (got {x.clip_low}, {x.clip_high})")
    if x.beta != 0.0 and x.ref_logps is None:
        raise ValueError(f"algo.beta={x.beta} needs reference log-probabilities")
    if x.loss_agg == "seq_mean_token_sum_norm" and x.max_len <= 0:
        raise ValueError("loss_agg=seq_mean_token_sum_norm needs max_len > 0 (the generation budget)")
    if isinstance(x.adv, Ragged):
        if x.adv.num_tokens != x.logps.num_tokens or len(x.adv) != len(x.logps):
            raise ValueError(
                f"token advantages for {len(x.adv)} sequences / {x.adv.num_tokens} tokens, "
                f"log-probabilities for {len(x.logps)} / {x.logps.num_tokens}"
            )
    elif x.adv.numel() != len(x.logps):
        raise ValueError(f"{x.adv.numel()} advantages for {len(x.logps)} sequences")


def policy_loss(x: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss of this micro-batch divided by the global count, metric contributions): the surrogate
    `SURROGATES[x.kind]` on its ratio (the sequence's with `x.importance_level="sequence"`), plus
    `beta` times the k3 KL, aggregated by `x.loss_agg`."""
    check_policy_loss_inputs(x)
    global_tokens, global_seqs = max(float(x.global_tokens), 1.0), max(float(x.global_seqs), 1.0)
    logps, logps_N = x.logps, x.logps.values.float()
    device = logps_N.device
    old_N = logps_N.detach() if x.old_logps is None else x.old_logps.values.float().detach()
    if isinstance(x.adv, Ragged):
        adv_N = x.adv.values.float().detach().to(device)
    else:
        adv_N = logps.broadcast(x.adv.float().detach().to(device)).values
    keep_N = torch.ones_like(logps_N) if x.sampled is None else x.sampled.values.to(device=device, dtype=logps_N.dtype)
    kind = SURROGATES[x.kind]
    level = "sequence" if x.importance_level == "sequence" else kind.ratio
    ratio_N = torch.exp(importance_log_ratio(logps, old_N, keep_N, level))
    surrogate_N, clipped_frac_N = kind.loss(SurrogateTerms(ratio_N, logps_N, adv_N, x.clip_low, x.clip_high))
    pg_N = surrogate_N * keep_N
    if x.is_weights is not None:
        pg_N = pg_N * x.is_weights.values.float().detach().to(device)
    if x.keep_B is not None:
        pg_N = pg_N * logps.broadcast(x.keep_B.float().to(device)).values
    loss_N = pg_N
    metrics: dict[str, torch.Tensor] = {}
    if x.ref_logps is not None:
        kl_N = k3_kl(logps_N, x.ref_logps.values.float().detach()) * keep_N
        if x.beta != 0.0:
            loss_N = pg_N + x.beta * kl_N
        metrics["policy/kl"] = kl_N.detach().sum() / global_tokens

    counts = None if x.sampled is None else logps.with_values(keep_N)
    loss = aggregate(logps.with_values(loss_N), x.loss_agg, global_tokens, global_seqs, x.max_len, counts)
    metrics["policy/pg_loss"] = aggregate(
        logps.with_values(pg_N.detach()), x.loss_agg, global_tokens, global_seqs, x.max_len, counts
    )
    metrics["policy/clipfrac"] = (clipped_frac_N * keep_N).sum().detach() / global_tokens
    metrics["policy/approx_kl"] = (0.5 * (logps_N.detach() - old_N) ** 2 * keep_N).sum() / global_tokens
    if x.entropy is not None:
        metrics["policy/entropy"] = (x.entropy.values.float().detach().to(device) * keep_N).sum() / global_tokens
    return loss, metrics


def aggregate(
    per_token: Ragged, loss_agg: str, global_tokens: float, global_seqs: float, max_len: int = 0,
    counts: Ragged | None = None,
) -> torch.Tensor:
    """Reduce per-token values to this micro-batch's share of the global loss (docs/internals/algos.md,
    "Aggregation"). `counts` (1 per sampled token, 0 per observation) replaces each sequence's length
    in a per-sequence mean; the values of uncounted tokens must already be 0."""
    if loss_agg == "token_mean":
        return per_token.values.sum() / global_tokens
    if loss_agg == "seq_mean_token_mean":
        if counts is None:
            return per_token.mean_per_seq().sum() / global_seqs
        return (per_token.sum_per_seq() / counts.sum_per_seq().clamp(min=1.0)).sum() / global_seqs
    if loss_agg == "seq_mean_token_sum_norm":
        return per_token.sum_per_seq().sum() / (max_len * global_seqs)
    raise ValueError(f"algo.loss_agg={loss_agg!r}: choose one of {', '.join(LOSS_AGGS)}")
