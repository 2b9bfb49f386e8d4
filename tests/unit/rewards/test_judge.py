"""The LLM judge (`reward_model=judge`, rltrain/rewards/judge): scores read from verdicts (hand-made
cases), the prompt template over a row, and the judge asking a real OpenAI-compatible HTTP server
on 127.0.0.1 (a threaded stand-in written here: chat and completions, a key it checks, answers it
delays, fails or garbles on request) through the run's reward scorer: batching, concurrency,
timeouts, retries, unparsed verdicts and the key read from the environment, each counted."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from helpers import compose_config

from rltrain.rewards.judge.build import check_judge
from rltrain.rewards.judge.endpoint import Endpoint
from rltrain.rewards.judge.judge import LLMJudge
from rltrain.rewards.judge.prompts import compile_template, render_requests
from rltrain.rewards.judge.verdicts import score_from_text, score_from_top_tokens
from rltrain.rewards.scoring import RewardScorer, build_reward_fns
from rltrain.runtime.errors import UserError

PATTERN = re.compile(r"Score:\s*(-?\d+(?:\.\d+)?)")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Score: 7", 0.7),
        ("The answer is wrong. Score: 0", 0.0),
        ("First I thought Score: 2, but on reflection\nScore: 9.5", 0.95),  # the last match: the conclusion
        ("Score: 14", 1.0),  # clipped to the scale
        ("Score: -3", 0.0),
        ("score 7", None),  # the pattern is the user's: no match, no score
        ("", None),
    ],
)
def test_pattern_scores_are_the_last_match_over_the_scale(text, expected):
    score = score_from_text(text, PATTERN, 10.0)
    assert score == (None if expected is None else pytest.approx(expected))


def test_a_pattern_without_a_group_reads_the_whole_match():
    assert score_from_text("rated 3/4", re.compile(r"\d+(?=/4)"), 4.0) == pytest.approx(0.75)


def test_yes_probability_sums_the_yes_tokens_among_the_top_tokens():
    top = {" Yes": math.log(0.5), "yes": math.log(0.2), "No": math.log(0.25)}
    assert score_from_top_tokens(top, "Yes") == pytest.approx(0.7)
    assert score_from_top_tokens({"No": math.log(0.9)}, "Yes") == 0.0  # below every top token: read as 0
    assert score_from_top_tokens(None, "Yes") is None  # no log-probabilities returned: unparsed


def test_the_template_sees_the_columns_the_prompt_the_completion_and_the_reference():
    template = compile_template("Q: {{ prompt }} A: {{ completion | trim }} ref={{ reference }} level={{ level }}")
    texts = render_requests(template, ["1+1=", "2+2="], [" 2 ", "5"], {"solution": ["2", "4"], "level": [1, 2]}, "solution")
    assert texts == ["Q: 1+1= A: 2 ref=2 level=1", "Q: 2+2= A: 5 ref=4 level=2"]
    no_reference = render_requests(compile_template("{{ reference }}"), ["p"], ["c"], {}, "solution")
    assert no_reference == ["None"]  # a row without the reference column: None, not an error


def test_a_template_naming_a_missing_column_or_broken_stops_with_one_paragraph():
    with pytest.raises(UserError, match=r"names something the row does not have.*'answer'"):
        render_requests(compile_template("{{ difficulty }}"), ["p"], ["c"], {"answer": ["1"]}, None)
    with pytest.raises(UserError, match="not a valid Jinja template"):
        compile_template("{{ prompt ")


# --- a real OpenAI-compatible server ----------------------------------------------------------


class StandInJudge:
    """An OpenAI-compatible server on 127.0.0.1. The verdict on a judge prompt is `Score: N` where N
    is the number after `ANSWER=` in it, and its first token's top log-probabilities give `Yes`
    probability N/10; a prompt holding HANG is answered after `hang_s`, GARBLE gets a verdict with
    no score, FLAKY a 500 on its first try. Requests without `Bearer <key>` get a 401."""

    def __init__(self, key: str | None = None, hang_s: float = 3.0) -> None:
        self.key, self.hang_s = key, hang_s
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self.batch_sizes: list[int] = []
        self.seen: dict[str, int] = {}
        self.requests = 0
        self.id_prompts = 0
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge.lock:
                    judge.in_flight += 1
                    judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
                try:
                    status, answer = judge.answer(self.path, body, self.headers.get("Authorization"))
                    time.sleep(0.05)  # long enough for concurrent requests to overlap
                finally:
                    with judge.lock:
                        judge.in_flight -= 1
                data = json.dumps(answer).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the judge gave up on this request (its timeout)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def verdict(self, text: str) -> tuple[str, dict[str, float]]:
        if "HANG" in text:
            time.sleep(self.hang_s)
        if "GARBLE" in text:
            return "I cannot decide.", {"I": 0.0}
        n = int(re.search(r"ANSWER=(\d+)", text).group(1))
        return f"Looks fine. Score: {n}", {"Yes": math.log(max(n, 1e-9) / 10), "No": math.log(max(1 - n / 10, 1e-9))}

    def answer(self, path: str, body: dict, authorization: str | None) -> tuple[int, dict]:
        with self.lock:
            self.requests += 1
        if self.key is not None and authorization != f"Bearer {self.key}":
            return 401, {"error": {"message": "invalid api key"}}
        texts = body["prompt"] if path.endswith("/completions") and "messages" not in body else [body["messages"][0]["content"]]
        if texts and isinstance(texts[0], list):  # token ids (a served judge's): the stand-in's ids are code points
            self.id_prompts += len(texts)
            texts = ["".join(map(chr, ids)) for ids in texts]
        with self.lock:
            self.batch_sizes.append(len(texts))
            first_try = any(t not in self.seen for t in texts)
            for t in texts:
                self.seen[t] = self.seen.get(t, 0) + 1
        if any("FLAKY" in t for t in texts) and first_try:
            return 500, {"error": {"message": "overloaded"}}
        verdicts = [self.verdict(t) for t in texts]
        if path == "/v1/chat/completions":
            text, top = verdicts[0]
            content = [{"token": text[:1], "logprob": 0.0, "top_logprobs": [{"token": k, "logprob": v} for k, v in top.items()]}]
            return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": {"content": content}}]}
        choices = [{"index": i, "text": text, "logprobs": {"top_logprobs": [top]}} for i, (text, top) in enumerate(verdicts)]
        return 200, {"choices": choices[::-1]}  # out of order: the judge sorts by index

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand_in():
    server = StandInJudge(key="sk-test-123")
    yield server
    server.close()


TEMPLATE = "reward_model.template='Q {{ prompt }} ANSWER={{ completion }} {{ tag }}'"


def judge_scorer(url: str, *overrides: str) -> RewardScorer:
    cfg = compose_config("reward_model=judge", f"reward_model.url={url}", "reward_model.model=stand-in",
                         "reward_model.api_key_env=JUDGE_TEST_KEY", TEMPLATE, *overrides)
    fns = build_reward_fns(cfg, torch.device("cpu"))
    assert [rf.name for rf in fns] == ["addition_reward", "judge"]
    fns[0].weight = 0.0
    return RewardScorer(fns, cfg.reward, cfg.safety.collective_timeout_s)


def score(scorer: RewardScorer, completions: list[str], tags: list[str]) -> dict[str, list[float]]:
    n = len(completions)
    try:
        per_fn, _ = scorer.score(["1+1="] * n, completions, {"answer": ["2"] * n, "tag": tags}, groups=[0] * n)
    finally:
        scorer.close()
    return per_fn


def test_chat_judge_counts_timeouts_retries_and_unparsed_verdicts(stand_in, monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test-123")
    scorer = judge_scorer(stand_in.url, "reward_model.timeout_s=1", "reward_model.retries=1", "reward.max_failure_frac=0.5")
    per_fn = score(scorer, ["7", "3", "10", "5", "8", "6"], ["", "HANG", "GARBLE", "FLAKY", "", ""])
    assert per_fn["judge"] == pytest.approx([0.7, 0.0, 0.0, 0.5, 0.8, 0.6])
    assert per_fn["judge_timeouts"] == [0, 1, 0, 0, 0, 0]  # past its time on both tries: scored 0, counted
    assert per_fn["judge_unparsed"] == [0, 0, 1, 0, 0, 0]
    assert per_fn["judge_errors"] == [0] * 6
    assert per_fn["judge_retries"] == [0, 1, 0, 1, 0, 0]  # the hung request and the flaky one, each tried again once
    assert stand_in.max_in_flight > 1  # asked concurrently
    assert "judge_timeouts" in scorer.counted and "judge_unparsed" in scorer.counted  # summed over the step, not averaged


def test_completions_judge_batches_prompts_and_reads_the_yes_probability(stand_in, monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test-123")
    scorer = judge_scorer(stand_in.url, "reward_model.api=completions", "reward_model.batch_size=4",
                          "reward_model.score=yes_probability", "reward_model.concurrency=2")
    completions = [str(i % 11) for i in range(10)]
    per_fn = score(scorer, completions, ["GARBLE" if i == 9 else "" for i in range(10)])
    assert per_fn["judge"][:9] == pytest.approx([int(c) / 10 for c in completions[:9]], abs=1e-6)
    assert per_fn["judge"][9] == 0.0  # its top tokens hold no Yes: probability read as 0, a parsed verdict
    assert sum(per_fn["judge_unparsed"]) == 0
    assert sorted(stand_in.batch_sizes) == [2, 4, 4]  # batch_size prompts per request
    assert stand_in.max_in_flight <= 2


def test_a_judge_with_its_own_tokenizer_sends_token_ids(stand_in):
    """A served judge's requests carry the ids of rltrain's tokenizer, not text its server would
    tokenize its own way (the stand-in reads ids as code points)."""
    rm = compose_config("reward_model=judge", f"reward_model.url={stand_in.url}", "reward_model.model=m",
                        "reward_model.api=completions", TEMPLATE).reward_model
    encode = lambda texts: [[ord(c) for c in text] for text in texts]  # noqa: E731
    endpoint = Endpoint(stand_in.url, "m", "completions", "sk-test-123", 16, 0.0, top_tokens=False, encode=encode)
    out = LLMJudge(rm, endpoint, max_failure_frac=0.25, budget_s=60.0)(["1+1=", "1+1="], ["7", "4"], tag=["", ""])
    assert out["rewards"] == pytest.approx([0.7, 0.4])
    assert stand_in.id_prompts == 2


def test_a_wrong_key_stops_the_rank_naming_the_endpoint(stand_in, monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-wrong")
    scorer = judge_scorer(stand_in.url)
    with pytest.raises(UserError, match=r"the judge .* failed on 3 of the 3 samples.*HTTP 401.*api_key_env"):
        score(scorer, ["1", "2", "3"], ["", "", ""])
    assert stand_in.requests == 3  # one per sample: a refused request is not tried again


def test_a_judge_that_never_answers_costs_a_bounded_call_not_the_run(monkeypatch):
    server = StandInJudge(hang_s=30.0)
    try:
        monkeypatch.setenv("JUDGE_TEST_KEY", "unused")
        scorer = judge_scorer(server.url, "reward_model.timeout_s=0.5", "reward_model.retries=1", "reward_model.concurrency=2",
                              "reward.max_failure_frac=1.0")
        started = time.monotonic()
        per_fn = score(scorer, ["1", "2", "3", "4", "5", "6"], ["HANG"] * 6)
        elapsed = time.monotonic() - started
    finally:
        server.close()
    assert per_fn["judge"] == [0.0] * 6 and per_fn["judge_timeouts"] == [1.0] * 6
    bound = 2 * 0.5 + 0.5 * 2  # (retries + 1) x timeout_s + the backoff: requests not started by then are not sent
    assert elapsed < bound + 5.0, elapsed


def test_a_missing_key_variable_or_endpoint_is_refused_before_the_run(monkeypatch):
    monkeypatch.delenv("JUDGE_TEST_KEY", raising=False)
    cfg = compose_config("reward_model=judge", "reward_model.url=http://127.0.0.1:9/v1", "reward_model.model=m",
                         "reward_model.api_key_env=JUDGE_TEST_KEY")
    with pytest.raises(UserError, match="JUDGE_TEST_KEY.*not set"):
        check_judge(cfg.reward_model)
    with pytest.raises(UserError, match="exactly one of reward_model.path"):
        check_judge(compose_config("reward_model=judge").reward_model)
    with pytest.raises(UserError, match="needs reward_model.model"):
        check_judge(compose_config("reward_model=judge", "reward_model.url=http://h/v1").reward_model)
    with pytest.raises(UserError, match="at most one"):
        check_judge(compose_config("reward_model=judge", "reward_model.url=http://h/v1", "reward_model.model=m",
                                   "reward_model.pattern='(a)(b)'").reward_model)


def test_a_replica_peer_serves_no_judge_but_names_the_same_series(tmp_path):
    # A model-parallel replica's lead scores and sends the scores to its peers (rltrain/algos/rl/builder.py):
    # a peer starts no judge server. A path that is no model shows which side tries to serve it: the
    # lead reads its tokenizer first and fails there, before it starts a server (no server log).
    model, lead_dir, peer_dir = (tmp_path / name for name in ("model", "lead", "peer"))
    for d in (model, lead_dir, peer_dir):
        d.mkdir()
    cfg = compose_config("reward_model=judge", f"reward_model.path={model}")
    with pytest.raises((UserError, ValueError, OSError)):
        build_reward_fns(cfg, torch.device("cpu"), lead_dir, rank=0, scores=True)
    assert not any(lead_dir.iterdir())
    fns = build_reward_fns(cfg, torch.device("cpu"), peer_dir, rank=1, scores=False)
    assert [rf.name for rf in fns] == ["addition_reward", "judge"] and not any(peer_dir.iterdir())  # no server log
    scorer = RewardScorer(fns, cfg.reward, cfg.safety.collective_timeout_s, start_workers=False)
    url_cfg = compose_config("reward_model=judge", "reward_model.url=http://127.0.0.1:9/v1", "reward_model.model=m")
    lead = RewardScorer(build_reward_fns(url_cfg, torch.device("cpu")), cfg.reward, 60.0, start_workers=False)
    assert scorer.series_names() == lead.series_names() and "judge_timeouts" in lead.series_names()
    scorer.close()
    lead.close()
    with pytest.raises(RuntimeError, match="only the replica's lead scores"):
        fns[1].fn(["1+1="], ["2"])
