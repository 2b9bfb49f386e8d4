"""GRPO's advantage: group-relative, one scalar per completion (a pure torch function).

The reward minus the mean reward of its group (the `group_size` completions of one prompt), then
divided by `std + eps` where std is the *unbiased* (n-1) standard deviation of the rewards of the
group (`scale_rewards=group`, GRPO), of the whole batch (`batch`, as in Lite PPO and TRL), or not
divided (`none`, Dr. GRPO). A group whose rewards are all equal gets advantage 0. No value
function, no GAE, no reward whitening across steps. Call it on the *global* batch of rewards (they
are small), so that `batch` scaling does not depend on the number of ranks. The loss that consumes
it is rltrain/algos/policy_loss.py.
"""

from __future__ import annotations

import torch

SCALES = ("group", "batch", "none")


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
