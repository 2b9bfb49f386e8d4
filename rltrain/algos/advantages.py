"""Advantages, as pure torch functions: GRPO's group-relative advantage (one scalar per completion),
on-policy distillation's per-token reverse KL, and PPO's per-token rewards, GAE, whitening and explained variance (from sums that can be
all-reduced, so the rank count does not change them). docs/internals/algos.md has the definitions.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from rltrain.data.ragged import Ragged

# --- GRPO --------------------------------------------------------------------------------------

ScaleRewards = Literal["group", "batch", "none"]  # algo.scale_rewards (GRPOConfig)
SCALES: tuple[str, ...] = get_args(ScaleRewards)


def group_advantages(
    rewards_B: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-6
) -> torch.Tensor:
    """[B] float32 advantages of `B = num_groups * group_size` rewards laid out group after group
    (the rollout engines' prompt-major order). Computed in float64 from the rewards as scored and
    cast at the end: rewards closer than float32's resolution (0.99 and 0.99 + 1e-7) would round to
    one value, and centring them after the cast would give the whole group one sign."""
    if scale not in SCALES:
        raise ValueError(f"algo.scale_rewards={scale!r}: choose one of {', '.join(SCALES)}")
    if group_size < 1 or rewards_B.numel() % group_size:
        raise ValueError(f"{rewards_B.numel()} rewards do not split into groups of {group_size}")
    rewards_GK = rewards_B.double().view(-1, group_size)
    # Each group is shifted by its first reward before averaging: the differences of near-equal
    # rewards are exact, so their mean is accurate to the gaps themselves, where the mean of the raw
    # rewards would carry a rounding error of the rewards' size (1e-16 at 1, against gaps of 1e-9).
    shifted_GK = rewards_GK - rewards_GK[:, :1]
    # A group of equal rewards carries no signal: its advantages are exactly 0.
    tied_G1 = rewards_GK.amax(dim=1, keepdim=True) == rewards_GK.amin(dim=1, keepdim=True)
    centred_GK = torch.where(tied_G1, 0.0, shifted_GK - shifted_GK.mean(dim=1, keepdim=True))
    if scale == "none":
        return centred_GK.reshape(-1).float()
    if scale == "group":
        std = shifted_GK.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred_GK[:, :1])
    else:
        flat_B = rewards_GK.reshape(-1)
        std = (flat_B - flat_B[0]).std() if flat_B.numel() > 1 else flat_B.new_zeros(())
    return (centred_GK / (std + eps)).reshape(-1).float()


# --- on-policy distillation -------------------------------------------------------------------


def reverse_kl_advantages(student: Ragged, teacher: Ragged) -> Ragged:
    """Per-token advantage `log p_teacher(y_t) - log p_student(y_t)` of the student's own samples:
    the negated single-sample estimate of the reverse KL at token t, as a reward with no discount, so
    the policy loss moves each sampled token towards the teacher's probability of it."""
    if student.num_tokens != teacher.num_tokens or len(student) != len(teacher):
        raise ValueError(f"teacher log-probabilities for {len(teacher)} sequences / {teacher.num_tokens} tokens, student's for {len(student)} / {student.num_tokens}")
    return student.with_values(teacher.values.float().cpu() - student.values.float().cpu())


# --- PPO ---------------------------------------------------------------------------------------


def token_rewards(scores_B: torch.Tensor, template: Ragged, kl_N: torch.Tensor | None = None, kl_coef: float = 0.0) -> Ragged:
    """Per-token rewards laid out like `template`: `-kl_coef * kl_N` plus each score on its
    sequence's last token."""
    rewards_N = torch.zeros(template.num_tokens, dtype=torch.float32, device="cpu")
    if kl_N is not None and kl_coef != 0.0:
        rewards_N = rewards_N - kl_coef * kl_N.float().cpu()
    lengths_B = template.lengths()
    has_tokens = lengths_B > 0
    last_N = template.offsets[1:][has_tokens] - 1
    rewards_N[last_N] += scores_B.float().cpu()[has_tokens]
    return template.with_values(rewards_N)


def gae(rewards: Ragged, values: Ragged, gamma: float, lam: float) -> tuple[Ragged, Ragged]:
    """(advantages, returns), ragged like `rewards`; `values` are the old values V_t."""
    if rewards.num_tokens != values.num_tokens:
        raise ValueError(f"{rewards.num_tokens} rewards for {values.num_tokens} values")
    rewards_BT, mask_BT = rewards.to_padded()
    values_BT, _ = values.to(rewards.values.device).to_padded()
    values_BT = values_BT.float() * mask_BT  # right padding: V = 0 and r = 0 after the last token
    rewards_BT = rewards_BT.float()
    adv_BT = torch.zeros_like(rewards_BT)
    running_B = torch.zeros(rewards_BT.shape[0], dtype=torch.float32, device="cpu")
    for t in reversed(range(rewards_BT.shape[1])):
        next_B = values_BT[:, t + 1] if t + 1 < rewards_BT.shape[1] else torch.zeros_like(running_B)
        delta_B = rewards_BT[:, t] + gamma * next_B - values_BT[:, t]
        running_B = delta_B + gamma * lam * running_B
        adv_BT[:, t] = running_B
    adv_N = adv_BT[mask_BT]
    return rewards.with_values(adv_N), rewards.with_values(adv_N + values_BT[mask_BT])


def on_sampled(x: Ragged, sampled: Ragged | None) -> Ragged:
    """`x` restricted to the tokens the policy sampled (each sequence keeps its own, in order): what
    PPO's rewards, values and GAE run over in a multi-turn episode, where observation tokens are
    context, not actions (docs/environments.md). `sampled` None: every token, `x` itself."""
    if sampled is None:
        return x
    keep_N = sampled.values.to(device=x.values.device, dtype=torch.bool)
    counts_B = sampled.with_values(sampled.values.long()).sum_per_seq().cpu()
    return Ragged.from_lengths(x.values[keep_N], counts_B)


def scatter_sampled(part: Ragged, sampled: Ragged | None, template: Ragged) -> Ragged:
    """`part` (laid out by `on_sampled`) back at its tokens of `template`, 0 at the others."""
    if sampled is None:
        return part
    out_N = torch.zeros(template.num_tokens, dtype=part.values.dtype, device=part.values.device)
    out_N[sampled.values.to(device=out_N.device, dtype=torch.bool)] = part.values
    return template.with_values(out_N)


def whiten(values_N: torch.Tensor, mean: float, var: float, eps: float = 1e-8) -> torch.Tensor:
    """`(x - mean) / sqrt(var + eps)` with the global batch's mean and (biased) variance."""
    return (values_N - mean) / (var + eps) ** 0.5


def moments_sums(values_N: torch.Tensor) -> torch.Tensor:
    """[count, sum, sum of squares] in float64: all-reduce these, then `moments`."""
    v = values_N.double()
    return torch.stack([torch.tensor(float(v.numel()), dtype=torch.float64, device=v.device), v.sum(), (v * v).sum()])


def moments(sums: torch.Tensor) -> tuple[float, float]:
    """(mean, biased variance) from summed `moments_sums`."""
    count = max(float(sums[0]), 1.0)
    mean = float(sums[1]) / count
    return mean, max(float(sums[2]) / count - mean * mean, 0.0)


def explained_variance_sums(returns_N: torch.Tensor, values_N: torch.Tensor) -> torch.Tensor:
    """[count, sum R, sum R^2, sum (R-V), sum (R-V)^2] in float64: all-reduce, then
    `explained_variance`."""
    r, e = returns_N.double(), (returns_N.double() - values_N.double().to(returns_N.device))
    count = torch.tensor(float(r.numel()), dtype=torch.float64, device=r.device)
    return torch.stack([count, r.sum(), (r * r).sum(), e.sum(), (e * e).sum()])


def explained_variance(sums: torch.Tensor) -> float:
    """`1 - Var(R - V) / Var(R)`; 0 when the returns do not vary."""
    _, var_r = moments(sums[:3])
    _, var_e = moments(torch.stack([sums[0], sums[3], sums[4]]))
    return 1.0 - var_e / var_r if var_r > 1e-12 else 0.0
