"""DAPO's soft overlong punishment: a reward term that grows from 0 to `-penalty` over the last
`buffer` tokens of the generation budget, so the policy learns to finish before it is cut off
instead of being scored on truncated answers. docs/algorithms.md ("The objectives by name").
"""

from __future__ import annotations


def overlong_penalties(lengths: list[int], max_new_tokens: int, buffer: int, penalty: float) -> list[float]:
    """The term for each completion of `lengths` tokens: 0 up to `max_new_tokens - buffer` tokens,
    then `-penalty * (length - (max_new_tokens - buffer)) / buffer`, and `-penalty` beyond the budget
    (a multi-turn episode's completion can be longer). `buffer=0` turns it off."""
    if buffer <= 0:
        return [0.0] * len(lengths)
    start = max_new_tokens - buffer
    return [-penalty * min(1.0, max(0, n - start) / buffer) for n in lengths]
