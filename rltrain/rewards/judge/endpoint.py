"""One request to an OpenAI-compatible endpoint (vLLM's server, OpenAI, any proxy), with the
standard library only (rltrain/transport/http_json.py): `/completions` with a batch of raw prompts
or `/chat/completions` with one user message, each bounded by a timeout. A failure is one of three kinds, because they are counted
and retried differently: `JudgeTimeout` (no answer in time), `JudgeUnavailable` (refused, reset, a
5xx: worth another try) and `JudgeRefused` (a 4xx such as a wrong key or model name: it would fail
again). docs/rewards-and-roles.md, "The LLM judge".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rltrain.transport.http_json import Failures, request_json

TOP_TOKENS = 20  # score=yes_probability: top tokens asked for (vLLM's default cap, --max-logprobs)


class JudgeTimeout(TimeoutError):
    """The endpoint did not answer within `reward_model.timeout_s`."""


class JudgeUnavailable(ConnectionError):
    """Refused, reset, or an HTTP 5xx: the endpoint may answer a later try."""


class JudgeRefused(ValueError):
    """An HTTP 4xx or an answer that is not the API's: another try would fail the same way."""


JUDGE_FAILURES = Failures(timeout=JudgeTimeout, unavailable=JudgeUnavailable, refused=JudgeRefused)


@dataclass(frozen=True)
class Endpoint:
    url: str  # the API's base, ending before /completions (e.g. http://host:8000/v1)
    model: str
    api: str  # "chat" or "completions"
    api_key: str | None
    max_tokens: int
    temperature: float
    top_tokens: bool  # ask for the first verdict token's top log-probabilities
    # api=completions: the prompts' token ids, sent in place of the texts (a served judge: its
    # server's own tokenizer loading may not read a text as rltrain's tokenizer does)
    encode: Callable[[list[str]], list[list[int]]] | None = None


@dataclass(frozen=True)
class Verdict:
    text: str
    top_logprobs: dict[str, float] | None  # the first verdict token's top tokens, when asked for


def ask(endpoint: Endpoint, texts: list[str], timeout_s: float) -> list[Verdict]:
    """The verdicts on `texts` (several only with api=completions, in one request)."""
    body: dict[str, Any] = {"model": endpoint.model, "max_tokens": endpoint.max_tokens, "temperature": endpoint.temperature}
    if endpoint.api == "completions":
        body["prompt"] = endpoint.encode(texts) if endpoint.encode is not None else texts
        if endpoint.top_tokens:
            body["logprobs"] = TOP_TOKENS
        answer = _post(endpoint, "/completions", body, timeout_s)
        return completion_verdicts(answer, len(texts))
    if len(texts) != 1:
        raise ValueError("the chat API takes one judge prompt per request")
    body["messages"] = [{"role": "user", "content": texts[0]}]
    if endpoint.top_tokens:
        body.update(logprobs=True, top_logprobs=TOP_TOKENS)
    answer = _post(endpoint, "/chat/completions", body, timeout_s)
    return [chat_verdict(answer)]


def _post(endpoint: Endpoint, path: str, body: dict[str, Any], timeout_s: float) -> Any:
    url = endpoint.url.rstrip("/") + path
    return request_json(url, body, timeout_s, JUDGE_FAILURES, api_key=endpoint.api_key, detail_chars=500)


def completion_verdicts(answer: Any, n: int) -> list[Verdict]:
    try:
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        verdicts = []
        for choice in choices:
            logprobs = choice.get("logprobs") or {}
            tops = logprobs.get("top_logprobs") or []
            verdicts.append(Verdict(choice.get("text") or "", dict(tops[0]) if tops and tops[0] else None))
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise JudgeRefused(f"the endpoint's /completions answer is not the API's: {str(answer)[:200]}") from exc
    if len(verdicts) != n:
        raise JudgeRefused(f"the endpoint answered {len(verdicts)} choices for {n} prompts")
    return verdicts


def chat_verdict(answer: Any) -> Verdict:
    try:
        choice = answer["choices"][0]
        text = (choice.get("message") or {}).get("content") or ""
        content = (choice.get("logprobs") or {}).get("content") or []
        tops = content[0].get("top_logprobs") if content else None
        top = {t["token"]: float(t["logprob"]) for t in tops} if tops else None
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        raise JudgeRefused(f"the endpoint's /chat/completions answer is not the API's: {str(answer)[:200]}") from exc
    return Verdict(text, top)
