"""Scores from a judge's verdicts, in [0, 1], or None where a verdict holds none (counted as
`reward/judge_unparsed`, scored 0).

`pattern`: the last match of `reward_model.pattern` in the verdict's text (its first group, else
the whole match), divided by `reward_model.max_score` and clipped, so `Score: 7` of 10 is 0.7 and
a judge that reasons before its score is read at its conclusion. `yes_probability`: the probability
the judge gives `reward_model.yes_token` as its first verdict token, read from the top tokens the
endpoint returns (tokens compared without surrounding spaces and case, so ` Yes` and `yes` count):
a graded score even from a judge that only says yes or no."""

from __future__ import annotations

import math
import re


def score_from_text(text: str, pattern: re.Pattern[str], max_score: float) -> float | None:
    matches = list(pattern.finditer(text))
    if not matches:
        return None
    found = matches[-1]
    raw = found.group(1) if pattern.groups else found.group(0)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(value):
        return None
    return min(1.0, max(0.0, value / max_score))


def score_from_top_tokens(top_logprobs: dict[str, float] | None, yes_token: str) -> float | None:
    """P(yes) from the first position's top tokens and their log-probabilities (None: the endpoint
    returned none; a yes token absent from them has a probability below theirs, read as 0)."""
    if not top_logprobs:
        return None
    wanted = yes_token.strip().lower()
    probability = sum(math.exp(lp) for token, lp in top_logprobs.items() if token.strip().lower() == wanted)
    return min(1.0, probability)
