"""GRPO math: group-relative advantages and the clipped policy loss (pure torch functions).

Run it with `python -m rltrain algo=grpo` (e.g. `algo.loss_agg=seq_mean_token_mean algo.beta=0.04`
for the original GRPO recipe, the defaults for DAPO's). The choices this module makes:

- **Advantage** (`group_advantages`): one scalar per completion, broadcast onto its tokens. The
  reward minus the mean reward of its group (the `group_size` completions of one prompt), then
  divided by `std + eps` where std is the *unbiased* (n-1) standard deviation of the rewards of
  the group (`scale_rewards=group`, GRPO), of the whole batch (`batch`, as in Lite PPO and TRL),
  or not divided (`none`, Dr. GRPO). A group whose rewards are all equal gets advantage 0.
  No value function, no GAE, no reward whitening across steps. Call it on the *global* batch of
  rewards (they are small), so that `batch` scaling does not depend on the number of ranks.
- **Policy term**: PPO's clipped surrogate per token, `max(-A r, -A clip(r, 1-clip_low,
  1+clip_high))` with `r = exp(logp - old_logp)`; asymmetric bounds as in DAPO ("clip-higher").
  `old_logp` is the log-probability under the policy that the batch was sampled for: the caller
  passes the trainer's own recomputation (not the rollout engine's sampling log-probabilities,
  whose agreement with the trainer is only *measured*). With one mini-batch and one iteration
  `old_logp = logp.detach()`, the ratio is 1 and this is exactly REINFORCE with a group baseline.
  No dual-clip, no truncated importance sampling against the rollout engine.
- **KL to the reference**: added to the loss (not to the reward), per token, with the k3 estimator
  `exp(ref - logp) - (ref - logp) - 1` (Schulman 2020; non-negative, unbiased for KL(pi||ref)),
  weighted by `beta`. With `beta=0` no reference model is needed; when reference log-probabilities
  are passed anyway, `policy/kl` is still reported.
- **Aggregation** (`loss_agg`), always divided by a *global* count (all micro-batches, all ranks),
  so that summing micro-batch losses gives the full-batch loss whatever the split:
  `token_mean` (DAPO): sum over every token / global token count. Every token weighs the same,
  so long completions are not diluted.
  `seq_mean_token_mean` (GRPO): mean over the tokens of each sequence, then sum / global sequence
  count. Every sequence weighs the same (this carries GRPO's length bias).
  `seq_mean_token_sum_norm` (Dr. GRPO): sum over the tokens of each sequence / a constant
  `max_len` (the generation budget), then sum / global sequence count. No length bias.
  An empty completion contributes 0 but still counts as a sequence.
- **Metrics**, each a per-token mean divided by the global token count (so that summing over
  micro-batches and ranks gives the mean, whatever `loss_agg` is): `policy/clip_fraction`
  (tokens whose clipped bound is the active one, i.e. that get no gradient from the policy term),
  `policy/kl` (k3), `policy/entropy` (when the backend computed it), and `policy/pg_loss` (the
  policy term alone, aggregated like the loss).
"""

from __future__ import annotations

import torch

from rltrain.data.ragged import Ragged

SCALES = ("group", "batch", "none")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def group_advantages(
    rewards_B: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-6
) -> torch.Tensor:
    """[B] advantages of `B = num_groups * group_size` rewards laid out group after group (the
    rollout engines' prompt-major order)."""
    if scale not in SCALES:
        raise ValueError(f"algo.scale_rewards={scale!r}: choose one of {', '.join(SCALES)}")
    if group_size < 1 or rewards_B.numel() % group_size:
        raise ValueError(f"{rewards_B.numel()} rewards do not split into groups of {group_size}")
    rewards_GK = rewards_B.float().view(-1, group_size)
    centred_GK = rewards_GK - rewards_GK.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred_GK.reshape(-1)
    if scale == "group":
        std = rewards_GK.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred_GK[:, :1])
    else:
        std = (
            rewards_B.float().std() if rewards_B.numel() > 1 else rewards_B.new_zeros((), dtype=torch.float32)
        )
    return (centred_GK / (std + eps)).reshape(-1)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): `exp(ref - logp) - (ref - logp) - 1` (>= 0)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def grpo_loss(
    logps: Ragged,
    adv_B: torch.Tensor,
    *,
    old_logps: Ragged | None = None,
    ref_logps: Ragged | None = None,
    entropy: Ragged | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    beta: float = 0.0,
    loss_agg: str = "token_mean",
    global_tokens: float,
    global_seqs: float,
    max_len: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss of this micro-batch divided by the global count, metric contributions).

    `logps` (differentiable), `old_logps`, `ref_logps` and `entropy` are ragged over the same
    completion tokens; `adv_B` has one advantage per sequence. `old_logps=None` means on-policy
    (`logps.detach()`). `global_tokens` / `global_seqs` count completion tokens / sequences over
    every micro-batch and rank of the optimizer step; `max_len` is Dr. GRPO's constant.
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
    if adv_B.numel() != len(logps):
        raise ValueError(f"{adv_B.numel()} advantages for {len(logps)} sequences")
    global_tokens, global_seqs = max(float(global_tokens), 1.0), max(float(global_seqs), 1.0)

    logps_N = logps.values.float()
    old_N = logps_N.detach() if old_logps is None else old_logps.values.float().detach()
    adv_N = logps.broadcast(adv_B.float().detach().to(logps_N.device)).values
    ratio_N = torch.exp(logps_N - old_N)
    unclipped_N = -adv_N * ratio_N
    clipped_N = -adv_N * torch.clamp(ratio_N, 1.0 - clip_low, 1.0 + clip_high)
    pg_N = torch.maximum(unclipped_N, clipped_N)
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
    metrics["policy/clip_fraction"] = (clipped_N > unclipped_N).float().sum().detach() / global_tokens
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
