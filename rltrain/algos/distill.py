"""On-policy distillation: the policy (the student) samples from the prompts, a frozen teacher
(`teacher.path`) scores the same tokens, and the per-token reverse KL to the teacher is the objective.

The reverse KL's single-sample estimate `log p_student(y_t) - log p_teacher(y_t)` on the student's
own tokens is used as a negative per-token reward with no discount (`reverse_kl_advantages`), through
the shared RL step and policy loss (rltrain/algos/rl.py), so the rollout engines, LoRA, both backends
and generating ahead work as for GRPO. Simplified: no rewards (reward.fns still score the samples,
as a metric only), no baseline. docs/algorithms.md ("On-policy distillation").

    python -m rltrain algo=distill teacher.path=outputs/.../final
"""

from __future__ import annotations

import torch

from rltrain.algos.advantages import reverse_kl_advantages
from rltrain.algos.experience import Experience
from rltrain.algos.rl import Advantages, RLAlgorithm
from rltrain.data.sharding import sum_over_replicas


class Distill(RLAlgorithm):
    def needs_old_logps_first(self) -> bool:
        return True  # the advantages compare the teacher with the student before its update

    def advantages(self, exp: Experience) -> Advantages:
        assert exp.old_logps is not None and exp.ref_logps is not None, "distillation scores the student and the teacher"
        adv = reverse_kl_advantages(exp.old_logps, exp.ref_logps)
        sums = torch.tensor([float(-adv.values.sum()), float(adv.num_tokens)], dtype=torch.float64, device="cpu")
        kl_sum, tokens = sum_over_replicas(sums, self.policy.world_size).tolist()
        return Advantages(adv, {"distill/reverse_kl": kl_sum / max(tokens, 1.0)})
