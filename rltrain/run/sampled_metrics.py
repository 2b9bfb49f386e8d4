"""What K sampled completions per held-out prompt say beyond the greedy one: pass@k, mean@K, maj@K.

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code"): with n samples of which c are correct, the chance that k drawn without replacement hold at
least one correct one, 1 - C(n-c, k) / C(n, k), computed as a product so that no binomial coefficient
is ever formed (C(200, 100) overflows a float). mean@K is the mean reward of the K samples; maj@K
scores the most frequent answer (stripped text; the first seen wins a tie). docs/evaluation.md.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k of n samples (c correct) include a correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:  # every draw of k includes a correct sample
        return 1.0
    miss = 1.0
    for j in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) = prod_{j=n-c+1}^{n} (1 - k/j)
        miss *= 1.0 - k / j
    return 1.0 - miss


def default_ks(samples: int) -> list[int]:
    """`eval.k` left null: 1, 2, 4, ... below `samples`, and `samples` itself."""
    ks, k = [], 1
    while k < samples:
        ks.append(k)
        k *= 2
    return [*ks, samples]


@dataclass
class PromptSamples:
    """One held-out prompt's K samples: their answers (stripped text), correctness and rewards."""

    answers: list[str]
    correct: list[bool]
    rewards: list[float]


def majority_correct(prompt: PromptSamples) -> bool:
    """Whether the most frequent answer is a correct one (ties: the answer seen first)."""
    counts = Counter(prompt.answers)
    top = max(counts.values())
    winner = next(a for a in prompt.answers if counts[a] == top)
    return prompt.correct[prompt.answers.index(winner)]


def metric_sums(prompts: list[PromptSamples], ks: list[int]) -> list[float]:
    """Per-metric sums over `prompts` (to be summed over ranks, then divided by the prompt count), in
    the order of `metric_keys(ks, K)`."""
    sums = [0.0] * (len(ks) + 2)
    for p in prompts:
        n, c = len(p.correct), sum(p.correct)
        for i, k in enumerate(ks):
            sums[i] += pass_at_k(n, c, k)
        sums[len(ks)] += sum(p.rewards) / n
        sums[len(ks) + 1] += float(majority_correct(p))
    return sums


def metric_keys(ks: list[int], samples: int) -> list[str]:
    """`eval/pass@k` for each k, `eval/mean@K`, `eval/maj@K`: the metrics.jsonl keys."""
    return [*(f"eval/pass@{k}" for k in ks), f"eval/mean@{samples}", f"eval/maj@{samples}"]
