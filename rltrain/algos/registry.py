"""Every algorithm, listed once: the `AlgorithmSpec` each module `rltrain/algos/<name>.py` declares.
rltrain.config.algorithms reads this list (by name, on first use) for validation, the `algo`
group's schemas, the engines' roles and the trainer. docs/adding-an-algorithm.md.
"""

from __future__ import annotations

from rltrain.algos import distill, dpo, grpo, kto, orpo, ppo, rm, sft, simpo
from rltrain.config.algorithms import AlgorithmSpec

SPECS: tuple[AlgorithmSpec, ...] = (
    sft.SPEC, dpo.SPEC, simpo.SPEC, orpo.SPEC, kto.SPEC, rm.SPEC, grpo.SPEC, distill.SPEC, ppo.SPEC,
)
