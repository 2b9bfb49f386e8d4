"""The reward of `data=reasoning_gym`: each row's own dataset's `score_answer`, nothing to write.

A row carries its task, generator config and index (rltrain/data/reasoning_gym.py); the worker builds
that dataset once, generates the row's entry again and asks the package's verifier. The verifier is
package code run in the reward workers like any reward function: one that raises, hangs or returns
something other than a number costs its own samples (`reward/errors`, `reward/timeouts`), never the
run (docs/rewards-and-roles.md). docs/environments.md, "reasoning-gym".
"""

from __future__ import annotations

from math import isfinite

from rltrain.data.reasoning_gym import entry_of


def score_answer(
    prompts: list[str], completions: list[str], rg_task: list[str], rg_config: list[str], rg_index: list[int], **_: object
) -> list[float]:
    rewards = []
    for completion, task, config, index in zip(completions, rg_task, rg_config, rg_index, strict=True):
        dataset, entry = entry_of(task, config, int(index))
        score = float(dataset.score_answer(completion.strip(), entry))
        if not isfinite(score):
            raise ValueError(f"{task}.score_answer returned {score}")
        rewards.append(score)
    return rewards
