"""Built-in reward for the addition task: dense, checkable, in [0, 1].

A randomly initialised model emits random characters, so an exact-match reward alone would be
zero almost always and GRPO would have no signal. The reward therefore has three parts that a
policy can climb one after the other:

- 0.2 x the fraction of generated characters that are digits (the answer's alphabet);
- 0.2 if the completion stopped (EOS) after one to three characters (the answer's shape);
- 0.6 x closeness of the number read from the completion to the true sum,
  `max(0, 1 - |guess - answer| / 50)`, so a correct sum scores the full 0.6.

A correct, well-formed answer scores 1.0.
"""

from __future__ import annotations

DIGITS = set("0123456789")


def addition_reward(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
    rewards = []
    for completion, truth in zip(completions, answer, strict=True):
        text = completion.strip()
        digit_fraction = sum(c in DIGITS for c in text) / max(1, len(text))
        well_formed = 1.0 if 1 <= len(text) <= 3 and set(text) <= DIGITS else 0.0
        closeness = 0.0
        if text and set(text) <= DIGITS and len(text) <= 4:
            closeness = max(0.0, 1.0 - abs(int(text) - int(truth)) / 50.0)
        rewards.append(0.2 * digit_fraction + 0.2 * well_formed + 0.6 * closeness)
    return rewards


def exact_match(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
    """1.0 for the exact answer, else 0.0 (a sparse reward, for comparison)."""
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]
