"""Built-in reward for the addition task: checkable, in [0, 1], exact answers worth most.

Half of the reward is exact match: the policy is paid for right answers, so RL raises held-out
accuracy instead of only the shape of its outputs. The other half is dense and graded, so that a
randomly initialised model (which emits random characters and is never exactly right) still has
a signal to climb, one part after the other:

- 0.1 x the fraction of generated characters that are digits (the answer's alphabet);
- 0.1 x `max(0, 1 - |len(completion) - len(answer)| / 4)` (the answer's length, so the policy
  learns to stop);
- 0.3 x `max(0, 1 - |n - answer| / 100)` where n is the number formed by the completion's leading
  digits (at most four), so values closer to the true sum earn more;
- 0.5 x exact match (the stripped completion equals the answer).

A correct answer (then EOS) scores 1.0; the best wrong one scores under 0.5. With the shaped
parts alone a near miss scored within 0.01 of the right answer, and GRPO raised the reward from
0.2 to 0.8 while held-out accuracy stayed at 0.005.
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
