"""Every loss of rltrain, as pure torch functions: SFT, the preference family (DPO, SimPO, ORPO, the
reward model's Bradley-Terry loss, KTO on unpaired examples), the policy loss of GRPO and PPO (PPO's
clip, GSPO's sequence ratio, CISPO's clipped weight) and PPO's clipped value loss. Each returns a loss already divided by a *global* count (tokens or
sequences over every micro-batch and rank), so micro-batch size, accumulation and the rank count do
not change it. docs/internals/algos.md says what each one computes, with its sources, and what is
left out.
"""

from __future__ import annotations

import math
from typing import get_args

import torch
import torch.nn.functional as F

from rltrain.backends.base import PolicyOutput
from rltrain.config.algorithms import DPOLossType, ImportanceLevel, LossAgg, PolicyLossKind
from rltrain.data.batch import SequenceBatch
from rltrain.data.ragged import Ragged

# --- SFT ---------------------------------------------------------------------------------------


def sft_loss(output: PolicyOutput, batch: SequenceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed completion NLL over the global completion-token count (in `extras`)."""
    global_tokens = batch.extras["global_tokens"]
    loss = -output.policy_logps().values.sum() / global_tokens
    return loss, {}


# --- the preference family: on per-sequence log-probability sums of chosen and rejected ------
# completions (`_P`: one value per pair). docs/internals/algos.md, "Preference losses".

DPO_LOSSES: tuple[str, ...] = get_args(DPOLossType)


def dpo_pair_losses(
    policy_chosen_P: torch.Tensor,
    policy_rejected_P: torch.Tensor,
    ref_chosen_P: torch.Tensor,
    ref_rejected_P: torch.Tensor,
    beta: float,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lens_P: torch.Tensor | None = None,
    rejected_lens_P: torch.Tensor | None = None,
) -> torch.Tensor:
    """[P] loss of each pair. `ipo` compares per-token log-ratios (each sum over its completion's
    length, `chosen_lens_P` / `rejected_lens_P`): without it the squared target would grow with the
    completions' length (TRL's form, which the IPO authors confirmed)."""
    h_P = (policy_chosen_P - ref_chosen_P) - (policy_rejected_P - ref_rejected_P)
    eps = label_smoothing
    if loss == "sigmoid":
        return -(1 - eps) * F.logsigmoid(beta * h_P) - eps * F.logsigmoid(-beta * h_P)
    if loss == "robust":
        if not 0 <= eps < 0.5:
            raise ValueError(f"algo.label_smoothing={eps} must be in [0, 0.5) for the robust loss")
        return (-(1 - eps) * F.logsigmoid(beta * h_P) + eps * F.logsigmoid(-beta * h_P)) / (1 - 2 * eps)
    if loss == "hinge":
        return torch.relu(1 - beta * h_P)
    if loss == "ipo":
        if chosen_lens_P is None or rejected_lens_P is None:
            raise ValueError("the ipo loss needs the completion lengths (chosen_lens_P, rejected_lens_P)")
        per_token_h_P = (policy_chosen_P - ref_chosen_P) / chosen_lens_P.clamp(min=1) - (
            policy_rejected_P - ref_rejected_P
        ) / rejected_lens_P.clamp(min=1)
        return (per_token_h_P - 1 / (2 * beta)) ** 2
    raise ValueError(f"algo.loss={loss!r}: choose one of {', '.join(DPO_LOSSES)}")


def implicit_rewards(policy_P: torch.Tensor, ref_P: torch.Tensor, beta: float) -> torch.Tensor:
    return beta * (policy_P - ref_P)


def simpo_pair_losses(
    policy_chosen_mean_P: torch.Tensor, policy_rejected_mean_P: torch.Tensor, beta: float, gamma: float
) -> torch.Tensor:
    """[P] SimPO's loss (Meng et al. 2024, eq. 6): `-log s(beta (mean_c - mean_r) - gamma)` on the
    *per-token mean* log-probabilities, so no reference is needed and length is not rewarded;
    `gamma` is the target reward margin."""
    return -F.logsigmoid(beta * (policy_chosen_mean_P - policy_rejected_mean_P) - gamma)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012: expm1 near 0, log1p far)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_log_odds_ratio(policy_chosen_mean_P: torch.Tensor, policy_rejected_mean_P: torch.Tensor) -> torch.Tensor:
    """[P] ORPO's log odds ratio (Hong et al. 2024, eq. 4-6) of the per-token mean log-probabilities
    `m`: `log(odds_c / odds_r)` with `odds = p / (1 - p)`, `p = exp(m)`, in log space."""
    c_P, r_P = policy_chosen_mean_P.float(), policy_rejected_mean_P.float()
    return (c_P - r_P) - (log1mexp(c_P) - log1mexp(r_P))


def orpo_pair_losses(policy_chosen_mean_P: torch.Tensor, policy_rejected_mean_P: torch.Tensor) -> torch.Tensor:
    """[P] ORPO's odds-ratio term `-log s(log odds ratio)` (eq. 7), weighted by `algo.lambda_` and
    added to the chosen completions' NLL by the caller."""
    return -F.logsigmoid(orpo_log_odds_ratio(policy_chosen_mean_P, policy_rejected_mean_P))


def reward_pair_losses(
    rewards_chosen_P: torch.Tensor,
    rewards_rejected_P: torch.Tensor,
    margins_P: torch.Tensor | None = None,
    center_coefficient: float = 0.0,
) -> torch.Tensor:
    """[P] the Bradley-Terry loss of a reward model's scores, `-log s(r_c - r_r - margin)`, plus
    `center_coefficient * (r_c + r_r)^2`, which pins the scores' free offset near zero (the pair
    term sees only differences). The optional per-pair `margins_P` asks for a wider gap where the
    data says the preference is strong (Llama 2's margin, as TRL's RewardTrainer applies it)."""
    diff_P = rewards_chosen_P.float() - rewards_rejected_P.float()
    if margins_P is not None:
        diff_P = diff_P - margins_P.to(diff_P.device, diff_P.dtype)
    losses_P = -F.logsigmoid(diff_P)
    if center_coefficient:
        losses_P = losses_P + center_coefficient * (rewards_chosen_P.float() + rewards_rejected_P.float()) ** 2
    return losses_P


def kto_reference_kl(policy_mismatched_B: torch.Tensor, ref_mismatched_B: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z0 (Ethayarajh et al. 2024, eq. 7 and section 4.1): the batch's mean of
    `log pi(y'|x) - log ref(y'|x)` over mismatched pairs (each prompt with another example's
    completion), clamped at 0 and detached: a biased but cheap estimate of KL(pi || ref), no
    gradient flows through it."""
    return (policy_mismatched_B.float() - ref_mismatched_B.float()).mean().clamp(min=0).detach()


def kto_losses(
    policy_B: torch.Tensor,
    ref_B: torch.Tensor,
    desirable_B: torch.Tensor,
    kl: torch.Tensor | float,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """[B] KTO's loss of each unpaired example (eq. 7 with the constant lambda_y dropped, as TRL
    does): with `r = log pi - log ref` of its completion, a desirable one (`desirable_B` True) loses
    `desirable_weight * (1 - s(beta (r - z0)))`, an undesirable one
    `undesirable_weight * (1 - s(beta (z0 - r)))`; `kl` is z0 (`kto_reference_kl`)."""
    logratio_B = policy_B.float() - ref_B.float()
    desirable_B = desirable_B.to(device=logratio_B.device, dtype=torch.bool)
    kl_t = torch.as_tensor(kl, dtype=logratio_B.dtype, device=logratio_B.device).detach()
    desirable_loss_B = desirable_weight * (1 - torch.sigmoid(beta * (logratio_B - kl_t)))
    undesirable_loss_B = undesirable_weight * (1 - torch.sigmoid(beta * (kl_t - logratio_B)))
    return torch.where(desirable_B, desirable_loss_B, undesirable_loss_B)


# --- the policy loss (GRPO, PPO) --------------------------------------------------------------

LOSS_AGGS: tuple[str, ...] = get_args(LossAgg)
IMPORTANCE_LEVELS: tuple[str, ...] = get_args(ImportanceLevel)
POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLossKind)


def importance_log_ratio(
    logps: Ragged, old_N: torch.Tensor, keep_N: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """Per-token log importance ratio log(pi / pi_old), differentiable through `logps`.

    `sequence` (GSPO): every token carries its sequence's length-normalised log ratio (the mean over
    the sequence's counted tokens, `keep_N`), with the token's own gradient (GSPO-token: the value
    is the sequence's, the gradient flows through each log-probability), so a per-token advantage
    keeps its meaning and a per-sequence one gives GSPO's gradient exactly."""
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"algo.importance_level={level!r}: choose one of {', '.join(IMPORTANCE_LEVELS)}")
    logps_N = logps.values.float()
    log_ratio_N = logps_N - old_N
    if level == "token":
        return log_ratio_N
    counted = logps.with_values(keep_N)
    seq_mean_B = logps.with_values(log_ratio_N.detach() * keep_N).sum_per_seq() / counted.sum_per_seq().clamp(min=1.0)
    return logps_N - logps_N.detach() + logps.broadcast(seq_mean_B).values


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): `exp(ref - logp) - (ref - logp) - 1` (>= 0)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def policy_loss(
    logps: Ragged,
    adv: torch.Tensor | Ragged,
    *,
    old_logps: Ragged | None = None,
    ref_logps: Ragged | None = None,
    entropy: Ragged | None = None,
    is_weights: Ragged | None = None,
    keep_B: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    beta: float = 0.0,
    loss_agg: str = "token_mean",
    importance_level: str = "token",
    kind: str = "clip",
    global_tokens: float,
    global_seqs: float,
    max_len: int = 0,
    sampled: Ragged | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss of this micro-batch divided by the global count, metric contributions).

    `logps` (differentiable), `old_logps`, `ref_logps`, `entropy` and `is_weights` are ragged over
    the same completion tokens; `adv` is a [B] tensor (one advantage per sequence) or a Ragged (one
    per token); `keep_B` (bool) drops sequences from the surrogate. `old_logps=None` means
    on-policy (`logps.detach()`). `global_tokens` / `global_seqs` count completion tokens /
    sequences over every micro-batch and rank of the optimizer step; `max_len` is Dr. GRPO's
    constant. `sampled` (bool per token, multi-turn trajectories) keeps the tokens the policy
    sampled: the environment's observations get no gradient and count in no mean, and
    `global_tokens` then counts sampled tokens only.

    `kind="clip"` is PPO's clipped surrogate; `kind="cispo"` (CISPO) is `-A * sg(min(r, 1 + clip_high))
    * logp`: the weight is clipped and detached, so every token keeps a gradient. `importance_level`
    picks the ratio `r` (`importance_log_ratio`).
    """
    if kind not in POLICY_LOSSES:
        raise ValueError(f"algo.policy_loss={kind!r}: choose one of {', '.join(POLICY_LOSSES)}")
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"algo.loss_agg={loss_agg!r}: choose one of {', '.join(LOSS_AGGS)}")
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(
            f"clip bounds need 0 <= clip_low < 1 and clip_high >= 0 (got {clip_low}, {clip_high})"
        )
    if beta != 0.0 and ref_logps is None:
        raise ValueError(f"algo.beta={beta} needs reference log-probabilities")
    if loss_agg == "seq_mean_token_sum_norm" and max_len <= 0:
        raise ValueError("loss_agg=seq_mean_token_sum_norm needs max_len > 0 (the generation budget)")
    if isinstance(adv, Ragged):
        if adv.num_tokens != logps.num_tokens or len(adv) != len(logps):
            raise ValueError(f"token advantages for {len(adv)} sequences / {adv.num_tokens} tokens, log-probabilities for {len(logps)} / {logps.num_tokens}")
    elif adv.numel() != len(logps):
        raise ValueError(f"{adv.numel()} advantages for {len(logps)} sequences")
    global_tokens, global_seqs = max(float(global_tokens), 1.0), max(float(global_seqs), 1.0)

    logps_N = logps.values.float()
    device = logps_N.device
    old_N = logps_N.detach() if old_logps is None else old_logps.values.float().detach()
    if isinstance(adv, Ragged):
        adv_N = adv.values.float().detach().to(device)
    else:
        adv_N = logps.broadcast(adv.float().detach().to(device)).values
    keep_N = torch.ones_like(logps_N) if sampled is None else sampled.values.to(device=device, dtype=logps_N.dtype)
    ratio_N = torch.exp(importance_log_ratio(logps, old_N, keep_N, importance_level))
    if kind == "cispo":
        weight_N = torch.clamp(ratio_N.detach(), max=1.0 + clip_high)
        pg_N = -adv_N * weight_N * logps_N * keep_N
        clipped_frac_N = (ratio_N.detach() > 1.0 + clip_high).float()
    else:
        unclipped_N = -adv_N * ratio_N
        clipped_N = -adv_N * torch.clamp(ratio_N, 1.0 - clip_low, 1.0 + clip_high)
        pg_N = torch.maximum(unclipped_N, clipped_N) * keep_N
        clipped_frac_N = (clipped_N > unclipped_N).float()
    if is_weights is not None:
        pg_N = pg_N * is_weights.values.float().detach().to(device)
    if keep_B is not None:
        pg_N = pg_N * logps.broadcast(keep_B.float().to(device)).values
    loss_N = pg_N
    metrics: dict[str, torch.Tensor] = {}
    if ref_logps is not None:
        kl_N = k3_kl(logps_N, ref_logps.values.float().detach()) * keep_N
        if beta != 0.0:
            loss_N = pg_N + beta * kl_N
        metrics["policy/kl"] = kl_N.detach().sum() / global_tokens

    counts = None if sampled is None else logps.with_values(keep_N)
    loss = aggregate(logps.with_values(loss_N), loss_agg, global_tokens, global_seqs, max_len, counts)
    metrics["policy/pg_loss"] = aggregate(
        logps.with_values(pg_N.detach()), loss_agg, global_tokens, global_seqs, max_len, counts
    )
    metrics["policy/clipfrac"] = (clipped_frac_N * keep_N).sum().detach() / global_tokens
    metrics["policy/approx_kl"] = (0.5 * (logps_N.detach() - old_N) ** 2 * keep_N).sum() / global_tokens
    if entropy is not None:
        metrics["policy/entropy"] = (entropy.values.float().detach().to(device) * keep_N).sum() / global_tokens
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


# --- PPO's critic --------------------------------------------------------------------------------


def value_loss(
    values: Ragged, old_values: Ragged, returns: Ragged, vf_clip: float, global_tokens: float, sampled: Ragged | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(this micro-batch's share of the clipped value loss, metric contributions). With `sampled`
    (a multi-turn batch) only the policy's tokens count; `global_tokens` then counts those."""
    global_tokens = max(float(global_tokens), 1.0)
    v_N = values.values.float()
    device = v_N.device
    old_N = old_values.values.float().detach().to(device)
    ret_N = returns.values.float().detach().to(device)
    unclipped_N = (v_N - ret_N) ** 2
    clipped_v_N = old_N + torch.clamp(v_N - old_N, -vf_clip, vf_clip)
    clipped_N = (clipped_v_N - ret_N) ** 2
    loss_N = 0.5 * torch.maximum(unclipped_N, clipped_N)
    clipped_frac_N = (clipped_N > unclipped_N).float()
    if sampled is not None:  # observation tokens are context: no share of the loss
        keep_N = sampled.values.to(device=device, dtype=v_N.dtype)
        loss_N, clipped_frac_N = loss_N * keep_N, clipped_frac_N * keep_N
    loss = loss_N.sum() / global_tokens
    return loss, {
        "critic/value_loss": loss.detach(),
        "critic/vf_clipfrac": clipped_frac_N.sum().detach() / global_tokens,
    }
