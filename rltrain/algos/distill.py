"""On-policy distillation: the policy (the student) samples from the prompts, a frozen teacher
(`teacher.path`) scores the same tokens, and the per-token reverse KL to the teacher is the objective.

The reverse KL's single-sample estimate `log p_student(y_t) - log p_teacher(y_t)` on the student's
own tokens is used as a negative per-token reward with no discount (`reverse_kl_advantages`), through
the shared RL step and policy loss (rltrain/algos/rl/algorithm.py), so the rollout engines, LoRA, both backends
and generating ahead work as for GRPO. Simplified: no rewards (reward.fns still score the samples,
as a metric only), no baseline. docs/algorithms.md ("On-policy distillation").

    python -m rltrain algo=distill teacher.path=outputs/.../final
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltrain.algos.advantages import reverse_kl_advantages
from rltrain.algos.rl.algorithm import Advantages, RLAlgorithm
from rltrain.algos.rl.config import RLConfig, check_rl
from rltrain.algos.rl.experience import Experience
from rltrain.config.algorithms import AlgorithmSpec
from rltrain.data.sharding import sum_over_replicas
from rltrain.runtime.errors import UserError


@dataclass
class DistillConfig(RLConfig):
    """RL's sampling and policy loss with the per-token reverse KL to the teacher as the (negated)
    advantage; no rewards, no reference (`beta` stays 0)."""

    name: str = "distill"


def check_distill(algo: DistillConfig) -> None:
    check_rl(algo)
    if algo.beta != 0:
        raise UserError(
            f"algo.beta={algo.beta}: algo=distill builds no reference; its objective is already a KL, to the teacher. "
            "Leave algo.beta=0."
        )
    if algo.dynamic_sampling or algo.overlong_buffer:
        raise UserError(
            f"algo.dynamic_sampling={algo.dynamic_sampling} / algo.overlong_buffer={algo.overlong_buffer} with algo=distill: "
            "both act on rewards, and distillation trains on the teacher's log-probabilities alone. Set "
            "algo.dynamic_sampling=false and algo.overlong_buffer=0."
        )


class Distill(RLAlgorithm):
    def needs_old_logps_first(self) -> bool:
        return True  # the advantages compare the teacher with the student before its update

    def advantages(self, exp: Experience) -> Advantages:
        assert exp.old_logps is not None and exp.ref_logps is not None, "distillation scores the student and the teacher"
        adv = reverse_kl_advantages(exp.old_logps, exp.ref_logps)
        sums = torch.tensor([float(-adv.values.sum()), float(adv.num_tokens)], dtype=torch.float64, device="cpu")
        kl_sum, tokens = sum_over_replicas(sums, self.policy.world_size).tolist()
        return Advantages(adv, {"distill/reverse_kl": kl_sum / max(tokens, 1.0)})


SPEC = AlgorithmSpec(
    "distill", DistillConfig, Distill, "on-policy distillation: reverse KL to a teacher on the policy's samples",
    data="prompts", generates=True, teacher=True, check=check_distill,
)
