"""PPO's math: token rewards, GAE, whitening, the clipped value loss (pure torch functions).

What PPO here does, per completion token t of a sequence of T tokens:
- **Token rewards**: `r_t = -kl_coef * (old_t - ref_t)` when the KL to the reference goes into the
  reward (`algo.kl_in_reward`; k1 estimate, as in InstructGPT), else 0; the sequence's score (the
  weighted `reward.fns` / reward model) is added at its last token. An empty completion has no
  token and so no reward to learn from.
- **GAE** (Schulman 2016): `delta_t = r_t + gamma V_{t+1} - V_t` with `V_T = 0` (the episode ends
  with the completion), `A_t = delta_t + gamma lam A_{t+1}`, returns `R_t = A_t + V_t`, where
  `V_t` is the critic's value of the state before token t (old values, computed once per batch).
- **Whitening**: advantages minus their mean, divided by their standard deviation, both over every
  token of the *global* batch (so the rank count does not change them); the returns are not
  whitened.
- **Value loss**: `0.5 max((V - R)^2, (V_clip - R)^2)` with `V_clip = V_old + clip(V - V_old,
  -vf_clip, vf_clip)` (PPO2's clipped value loss), a token mean over the global token count.
  `critic/vf_clipfrac`: tokens where the clipped term is the larger one.
- **Explained variance**: `1 - Var(R - V) / Var(R)` over the global batch's tokens, from sums that
  can be all-reduced (`explained_variance_sums` then `explained_variance`).
No reward normalisation across steps, no value bootstrapping beyond the completion.
"""

from __future__ import annotations

import torch

from rltrain.data.ragged import Ragged


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


def value_loss(
    values: Ragged, old_values: Ragged, returns: Ragged, vf_clip: float, global_tokens: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(this micro-batch's share of the clipped value loss, metric contributions)."""
    global_tokens = max(float(global_tokens), 1.0)
    v_N = values.values.float()
    device = v_N.device
    old_N = old_values.values.float().detach().to(device)
    ret_N = returns.values.float().detach().to(device)
    unclipped_N = (v_N - ret_N) ** 2
    clipped_v_N = old_N + torch.clamp(v_N - old_N, -vf_clip, vf_clip)
    clipped_N = (clipped_v_N - ret_N) ** 2
    loss_N = 0.5 * torch.maximum(unclipped_N, clipped_N)
    loss = loss_N.sum() / global_tokens
    return loss, {
        "critic/value_loss": loss.detach(),
        "critic/vf_clipfrac": (clipped_N > unclipped_N).float().sum().detach() / global_tokens,
    }


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
