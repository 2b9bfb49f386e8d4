"""Built-in reward for the addition task: dense, checkable, in [0, 1].

A randomly initialised model emits random characters, so an exact-match reward alone would be
zero almost always and GRPO would have no signal. The reward therefore has three parts that a
policy can climb one after the other, each graded rather than all-or-nothing:

- 0.2 x the fraction of generated characters that are digits (the answer's alphabet);
- 0.2 x `max(0, 1 - |len(completion) - len(answer)| / 4)` (the answer's length, so the policy
  learns to stop);
- 0.6 x `max(0, 1 - |n - answer| / 100)` where n is the number formed by the completion's leading
  digits (at most four), so values closer to the true sum earn more.

A correct answer (then EOS) scores 1.0.
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
        rewards.append(0.2 * digit_fraction + 0.2 * length_score + 0.6 * closeness)
    return rewards


def exact_match(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
    """1.0 for the exact answer, else 0.0 (a sparse reward, for comparison)."""
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]
