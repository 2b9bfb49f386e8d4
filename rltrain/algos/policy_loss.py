"""The clipped policy loss that GRPO and PPO share (pure torch functions).

What it computes, per completion token: PPO's clipped surrogate `max(-A r, -A clip(r, 1-clip_low,
1+clip_high))` with `r = exp(logp - old_logp)`, asymmetric bounds as in DAPO ("clip-higher").
`old_logp` is the trainer's own recomputation under the weights the batch was sampled with (with
one mini-batch and one iteration, `logp.detach()`: ratio 1, REINFORCE with a baseline). The
advantage is one scalar per sequence (GRPO, broadcast onto its tokens) or one per token (PPO's GAE).

- **Rollout correction** (rltrain/algos/rollout_correction.py): optional per-token weights that
  multiply the surrogate (truncated importance sampling between trainer and engine), and a
  per-sequence keep mask (sequences whose train/rollout ratio left a band contribute nothing).
  Both are constants (no gradient). Dropped sequences still count in the denominators.
- **KL to the reference in the loss**: per token, the k3 estimator `exp(ref - logp) - (ref - logp)
  - 1` (Schulman 2020; non-negative, unbiased for KL(pi||ref)), weighted by `beta`. With reference
  log-probabilities and `beta=0`, `policy/kl` is still reported. (PPO can instead put the KL into
  the reward: rltrain/algos/ppo_math.py.)
- **Aggregation** (`loss_agg`), always divided by a *global* count (all micro-batches, all ranks),
  so that summing micro-batch losses gives the full-batch loss whatever the split:
  `token_mean` (DAPO): sum over every token / global token count; `seq_mean_token_mean` (GRPO):
  mean over each sequence's tokens, then sum / global sequence count (GRPO's length bias);
  `seq_mean_token_sum_norm` (Dr. GRPO): each sequence's sum / `max_len` (the generation budget),
  then sum / global sequence count. An empty completion contributes 0 but counts as a sequence.
- **Metrics**, each a per-token mean divided by the global token count (summing over micro-batches
  and ranks gives the mean): `policy/clipfrac` (tokens whose clipped bound is active, i.e. that get
  no gradient from the surrogate), `policy/approx_kl` (k2, `0.5 (logp - old_logp)^2`: how far this
  update has moved from the sampling policy), `policy/kl` (k3 to the reference), `policy/entropy`
  (when the backend computed it), `policy/pg_loss` (the surrogate alone, aggregated like the loss).
No dual-clip, no entropy bonus.
"""

from __future__ import annotations

import torch

from rltrain.data.ragged import Ragged

LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


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
    global_tokens: float,
    global_seqs: float,
    max_len: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss of this micro-batch divided by the global count, metric contributions).

    `logps` (differentiable), `old_logps`, `ref_logps`, `entropy` and `is_weights` are ragged over
    the same completion tokens; `adv` is a [B] tensor (one advantage per sequence) or a Ragged (one
    per token); `keep_B` (bool) drops sequences from the surrogate. `old_logps=None` means
    on-policy (`logps.detach()`). `global_tokens` / `global_seqs` count completion tokens /
    sequences over every micro-batch and rank of the optimizer step; `max_len` is Dr. GRPO's
    constant.
    """
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
    ratio_N = torch.exp(logps_N - old_N)
    unclipped_N = -adv_N * ratio_N
    clipped_N = -adv_N * torch.clamp(ratio_N, 1.0 - clip_low, 1.0 + clip_high)
    pg_N = torch.maximum(unclipped_N, clipped_N)
    if is_weights is not None:
        pg_N = pg_N * is_weights.values.float().detach().to(device)
    if keep_B is not None:
        pg_N = pg_N * logps.broadcast(keep_B.float().to(device)).values
    loss_N = pg_N
    metrics: dict[str, torch.Tensor] = {}
    if ref_logps is not None:
        kl_N = k3_kl(logps_N, ref_logps.values.float().detach())
        if beta != 0.0:
            loss_N = pg_N + beta * kl_N
        metrics["policy/kl"] = kl_N.detach().sum() / global_tokens

    loss = aggregate(logps.with_values(loss_N), loss_agg, global_tokens, global_seqs, max_len)
    metrics["policy/pg_loss"] = aggregate(
        logps.with_values(pg_N.detach()), loss_agg, global_tokens, global_seqs, max_len
    )
    metrics["policy/clipfrac"] = (clipped_N > unclipped_N).float().sum().detach() / global_tokens
    metrics["policy/approx_kl"] = (0.5 * (logps_N.detach() - old_N) ** 2).sum() / global_tokens
    if entropy is not None:
        metrics["policy/entropy"] = entropy.values.float().detach().sum() / global_tokens
    return loss, metrics


def aggregate(
    per_token: Ragged, loss_agg: str, global_tokens: float, global_seqs: float, max_len: int = 0
) -> torch.Tensor:
    """Reduce per-token values to this micro-batch's share of the global loss (see module doc)."""
    if loss_agg == "token_mean":
        return per_token.values.sum() / global_tokens
    if loss_agg == "seq_mean_token_mean":
        return per_token.mean_per_seq().sum() / global_seqs
    if loss_agg == "seq_mean_token_sum_norm":
        return per_token.sum_per_seq().sum() / (max_len * global_seqs)
    raise ValueError(f"algo.loss_agg={loss_agg!r}: choose one of {', '.join(LOSS_AGGS)}")
