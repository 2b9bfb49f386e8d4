"""Built-in reward for the addition task: checkable, in [0, 1], exact answers worth most.

Half of the reward is exact match, so RL raises held-out accuracy and not only the shape of the
outputs; the other half is dense and graded, so a randomly initialised model still has a signal
to climb. The parts, their weights and why exact match must dominate: docs/internals/rewards.md.
"""

from __future__ import annotations

DIGITS = set("0123456789")


def addition_reward(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
    rewards = []
    for completion, truth in zip(completions, answer, strict=True):
        text = completion.strip()
        digit_fraction = sum(c in DIGITS for c in text) / max(1, len(text))
        length_score = max(0.0, 1.0 - abs(len(text) - len(truth)) / 4.0)
        lead = ""
        for c in text[:4]:
            if c not in DIGITS:
                break
            lead += c
        closeness = max(0.0, 1.0 - abs(int(lead) - int(truth)) / 100.0) if lead else 0.0
        exact = float(text == truth.strip())
        rewards.append(0.1 * digit_fraction + 0.1 * length_score + 0.3 * closeness + 0.5 * exact)
    return rewards


def exact_match(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
    """1.0 for the exact answer, else 0.0 (a sparse reward, for comparison)."""
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]
