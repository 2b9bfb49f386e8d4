"""The judge as a reward function: one request per completion (`prompts.render_requests`),
`reward_model.batch_size` to a request (api=completions) and `reward_model.concurrency` at once;
each verdict's score from `verdicts`. It never hangs the run: each request is bounded by
`reward_model.timeout_s` and retried up to `reward_model.retries` times, the whole call by
(retries + 1) x timeout_s plus the backoff; a failed sample scores 0 and is counted
(reward/judge_timeouts, reward/judge_errors; reward/judge_unparsed for a verdict with no score).
Past `reward.max_failure_frac` failures the rank stops: a broken judge is never read as bad answers.
docs/rewards-and-roles.md, "The LLM judge".
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from rltrain.config.group_options import JudgeRewardModelConfig
from rltrain.rewards.judge.endpoint import (
    Endpoint,
    JudgeRefused,
    JudgeTimeout,
    JudgeUnavailable,
    Verdict,
    ask,
)
from rltrain.rewards.judge.prompts import compile_template, render_requests
from rltrain.rewards.judge.served import ServedJudge
from rltrain.rewards.judge.verdicts import score_from_text, score_from_top_tokens
from rltrain.runtime.errors import UserError

# Per-sample counts the judge reports (logged as reward/<name>, summed over the step's samples):
# requests past their time, verdicts with no score, requests refused or failed, and extra tries.
METRICS = ("judge_timeouts", "judge_unparsed", "judge_errors", "judge_retries")
BACKOFF_S = 0.5  # before a retry, doubled each time


@dataclass
class Outcome:
    """One request's end: its verdicts, or how it failed ("timeout", "error") and why."""

    verdicts: list[Verdict] | None
    failure: str = ""
    problem: str = ""
    retries: int = 0


class LLMJudge:
    """`fn(prompts, completions, **columns) -> {"rewards": [...], "metrics": {...}}`."""

    def __init__(
        self, rm: JudgeRewardModelConfig, endpoint: Endpoint, max_failure_frac: float, budget_s: float,
        served: ServedJudge | None = None,
    ) -> None:
        self.rm, self.endpoint, self.served = rm, endpoint, served
        self.max_failure_frac = max_failure_frac
        self.template = compile_template(rm.template)
        self.pattern = re.compile(rm.pattern)
        per_call = (rm.retries + 1) * rm.timeout_s + BACKOFF_S * (2 ** rm.retries)
        self.call_bound_s = min(per_call, budget_s)
        self.per_request = rm.batch_size if rm.api == "completions" else 1

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> dict[str, Any]:
        texts = render_requests(self.template, prompts, completions, columns, self.rm.reference_column)
        if self.served is not None:
            self.served.wait_ready()
            self.served.wake()
        try:
            outcomes = self.ask_all(texts)
        finally:
            if self.served is not None:
                self.served.sleep()
        return self.scored(outcomes, len(texts))

    def ask_all(self, texts: list[str]) -> list[tuple[int, int, Outcome]]:
        """Every request, concurrently, within the call's bound: (start, end, outcome) per request;
        a request still running or never started at the bound is a timeout."""
        bounds = [(s, min(s + self.per_request, len(texts))) for s in range(0, len(texts), self.per_request)]
        if not bounds:
            return []
        deadline = time.monotonic() + self.call_bound_s
        pool = ThreadPoolExecutor(max_workers=min(self.rm.concurrency, len(bounds)), thread_name_prefix="judge")
        try:
            futures = [pool.submit(self.ask_with_retries, texts[s:e], deadline) for s, e in bounds]
            wait(futures, timeout=self.call_bound_s + 1.0)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # a thread still in a request ends at its socket timeout
        late = Outcome(None, "timeout", f"got no verdict within the call's bound of {self.call_bound_s:g} s")
        return [(s, e, f.result() if f.done() and not f.cancelled() else late) for (s, e), f in zip(bounds, futures)]

    def ask_with_retries(self, texts: list[str], deadline: float) -> Outcome:
        retries = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Outcome(None, "timeout", f"got no verdict within the call's bound of {self.call_bound_s:g} s", retries)
            try:
                return Outcome(ask(self.endpoint, texts, min(self.rm.timeout_s, remaining)), retries=retries)
            except JudgeRefused as exc:
                return Outcome(None, "error", str(exc), retries)
            except (JudgeTimeout, JudgeUnavailable) as exc:
                if retries >= self.rm.retries:
                    return Outcome(None, "timeout" if isinstance(exc, JudgeTimeout) else "error", str(exc), retries)
                time.sleep(min(BACKOFF_S * 2**retries, max(0.0, deadline - time.monotonic())))
                retries += 1

    def scored(self, outcomes: list[tuple[int, int, Outcome]], n: int) -> dict[str, Any]:
        """Rewards and per-sample counts; stops the rank past `reward.max_failure_frac` failures."""
        rewards = [0.0] * n
        metrics = {name: [0.0] * n for name in METRICS}
        failed, first_problem = 0, ""
        for start, end, outcome in outcomes:
            metrics["judge_retries"][start] = float(outcome.retries)
            if outcome.verdicts is None:
                key = "judge_timeouts" if outcome.failure == "timeout" else "judge_errors"
                for i in range(start, end):
                    metrics[key][i] = 1.0
                failed += end - start
                first_problem = first_problem or outcome.problem
                continue
            for i, verdict in zip(range(start, end), outcome.verdicts, strict=True):
                score = self.score(verdict)
                if score is None:
                    metrics["judge_unparsed"][i] = 1.0
                else:
                    rewards[i] = score
        if failed > self.max_failure_frac * n:
            raise UserError(
                f"the judge ({self.endpoint.url}, model {self.endpoint.model!r}) failed on {failed} of the {n} samples "
                f"this rank scored, more than reward.max_failure_frac={self.max_failure_frac:g}; the first failure: "
                f"{first_problem}. Check that the endpoint runs and that reward_model.model and the key "
                "(reward_model.api_key_env) are right, or raise reward_model.timeout_s or reward_model.retries."
            )
        return {"rewards": rewards, "metrics": metrics}

    def score(self, verdict: Verdict) -> float | None:
        if self.rm.score == "yes_probability":
            return score_from_top_tokens(verdict.top_logprobs, self.rm.yes_token)
        return score_from_text(verdict.text, self.pattern, self.rm.max_score)

    def close(self) -> None:
        if self.served is not None:
            self.served.close()
