"""env=agent (rltrain/envs/agent/): agents with the real `openai` client in real call workers,
against the real endpoint; the engine is a scripted stand-in (a function of the ids it is given).
Every token served is recorded; calls that extend the conversation merge into one sequence, a
rewritten history starts a new one; a hung, crashing, silent or misbehaving agent fails its episode
only; what the endpoint cannot serve is a 400 the agent sees at once."""

from __future__ import annotations

import json
import select
import socket
import textwrap
import time
import urllib.error
import urllib.request
from dataclasses import replace

import pytest

from rltrain.config.group_options import AgentEnvConfig
from rltrain.config.schema import RewardConfig
from rltrain.data.prompt_data import PromptRow
from rltrain.envs.agent.endpoint import AgentEndpoint, ApiError, parse_chat_request
from rltrain.envs.agent.record import EpisodeRecord
from rltrain.envs.agent.reply import cut_reply
from rltrain.envs.agent.runner import AgentRunner
from rltrain.envs.episodes import TURN_SEED_STRIDE
from rltrain.models.tokenizer import build_char_tokenizer
from rltrain.rollout.base import Completion, SamplingSettings
from rltrain.runtime.errors import UserError

TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id
# The tiny tokenizer's template, with an assistant turn ending in the engine's stop token (as
# Qwen's <|im_end|> does): a conversation that goes on renders the sampled reply as it was sampled.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call><eos>{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)

AGENTS = textwrap.dedent('''
    import asyncio, json, os, pathlib, time
    import openai

    def talk(client, row):
        """Two calls; the second extends the first (the reply as served, then a user turn)."""
        messages = [{"role": "user", "content": row["prompt"]}]
        first = client.chat.completions.create(model="x", messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "again"}]
        second = client.chat.completions.create(model="x", messages=messages, max_tokens=8, temperature=0.5)
        return {"length": float(len(second.choices[0].message.content)), "bonus": 1.0}

    async def talk_async(client, row):
        reply = await client.chat.completions.create(model="x", messages=[{"role": "user", "content": row["prompt"]}])
        return 2.0 if reply.choices[0].message.content else 0.0

    def rewrite(client, row):
        """The second call drops the first reply: a history rewrite."""
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": row["prompt"]}])
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "summary"}])
        return 1.0

    def tools(client, row):
        tool = {"type": "function", "function": {"name": "mul", "parameters": {"type": "object", "properties": {}}}}
        reply = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "call " + row["prompt"]}], tools=[tool])
        calls = reply.choices[0].message.tool_calls or []
        return float(len(calls) == 1 and calls[0].function.name == "mul" and json.loads(calls[0].function.arguments) == {"a": 2})

    def own_client(client, row):
        """A framework that builds its own client from the environment."""
        mine = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"])
        mine.chat.completions.create(model="x", messages=[{"role": "user", "content": row["prompt"]}])
        return 1.0

    def streams(client, row):
        """A parameter the endpoint cannot serve: refused at once with a 400 naming it."""
        try:
            client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], stream=True)
        except openai.BadRequestError as exc:
            client.chat.completions.create(model="x", messages=[{"role": "user", "content": row["prompt"]}])
            return 1.0 if "stream" in str(exc) else 0.0
        return 0.0

    def conversational(client, row):
        """A chat dataset's row: its prompt is the messages, sent as they are."""
        client.chat.completions.create(model="x", messages=row["prompt"])
        return 1.0 if isinstance(row["prompt"], list) else 0.0

    def barrier(client, row):
        """Waits until every episode of the test has started (they must run at once), then talks
        through a client built from the environment: each reaches its own episode."""
        folder = pathlib.Path(row["folder"])
        (folder / row["tag"]).write_text("")
        deadline = time.monotonic() + 30
        while len(list(folder.iterdir())) < row["parties"]:
            if time.monotonic() > deadline:
                raise TimeoutError("the episodes did not run at once")
            time.sleep(0.01)
        openai.OpenAI().chat.completions.create(model="x", messages=[{"role": "user", "content": row["tag"]}])
        return 1.0

    async def barrier_async(client, row):
        folder = pathlib.Path(row["folder"])
        (folder / row["tag"]).write_text("")
        deadline = time.monotonic() + 30
        while len(list(folder.iterdir())) < row["parties"]:
            if time.monotonic() > deadline:
                raise TimeoutError("the episodes did not run at once")
            await asyncio.sleep(0.01)
        await openai.AsyncOpenAI().chat.completions.create(model="x", messages=[{"role": "user", "content": row["tag"]}])
        return 1.0

    async def blocks_its_loop(client, row):
        """On the rows tagged "block": a synchronous sleep inside async def (the worker's event loop
        stops for every episode on it); the others talk after a short await."""
        if row["tag"] == "block":
            time.sleep(1000)
        await asyncio.sleep(0.3)
        await client.chat.completions.create(model="x", messages=[{"role": "user", "content": row["prompt"]}])
        return 1.0

    def blocks_its_thread(client, row):
        """The synchronous agent's version: its own thread sleeps on the rows tagged "block"."""
        if row["tag"] == "block":
            time.sleep(1000)
        time.sleep(0.3)
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": row["prompt"]}])
        return 1.0

    def by_tag(client, row):
        """What each row's tag asks for: hang, raise, stay silent, return nonsense, or answer."""
        tag = row["tag"]
        if tag == "hang":
            client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hang"}])
            time.sleep(1000)
        if tag == "raise":
            raise RuntimeError("agent bug")
        if tag == "crash":
            os._exit(3)
        if tag == "silent":
            return 1.0
        if tag == "nonsense":
            client.chat.completions.create(model="x", messages=[{"role": "user", "content": "x"}])
            return "yes"
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": row["prompt"]}])
        return 1.0
''')


@pytest.fixture(autouse=True)
def warm_agent_workers(monkeypatch):
    """The agents' worker processes fork warm from the rank server, as a warm run's do (stand-ins:
    tests/stand_in.py); what they run is unchanged (docs/testing.md, "Warm ranks")."""
    from cli import torchrun_ranks_env

    for key, value in torchrun_ranks_env().items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def agents(tmp_path, monkeypatch) -> str:
    (tmp_path / "agent_fixtures.py").write_text(AGENTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "agent_fixtures"


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def scripted_generate(calls: list):
    """The engine stand-in: "ab" + EOS, or a tool call where the prompt asks for one; logprob of
    reply token j is -(j + 1) / 10. Records each engine call's prompts and settings."""

    def generate(prompts: list[list[int]], sampling: SamplingSettings, images: list | None = None) -> list[Completion]:
        calls.append(([list(p) for p in prompts], sampling))
        out = []
        for i, prompt in enumerate(prompts):
            text = TOKENIZER.decode(prompt)
            reply = '<tool_call>{"name": "mul", "arguments": {"a": 2}}</tool_call>' if "call " in text else "ab"
            for _ in range(sampling.n):
                reply_ids = ids(reply)[: sampling.max_new_tokens - 1] + [EOS]
                out.append(Completion(i, reply_ids, [-(j + 1) / 10 for j in range(len(reply_ids))], True))
        return out

    return generate


def rows(*tags: str) -> list[PromptRow]:
    return [PromptRow(ids(f"{t}|"), f"{t}|", {"tag": t}) for t in tags]


def play(agent: str, tags=("p0", "p1"), copies: int = 1, calls: list | None = None, reward=None, temperature: float = 1.0, **env):
    env = {"timeout_s": 30.0, "workers": 2, "chat_template": TEMPLATE, **env}
    runner = AgentRunner(AgentEnvConfig(agent=agent, **env), reward or RewardConfig(), TOKENIZER, 64, 64, 600)
    try:
        sampling = SamplingSettings(n=copies, temperature=temperature, stop_token_ids=[EOS], seed=5)
        return runner.run(rows(*tags), copies, sampling, "train-0", scripted_generate(calls if calls is not None else []))
    finally:
        runner.close()


# --- the record: the merge rule ----------------------------------------------------------------


def test_a_call_that_extends_the_last_one_continues_its_sequence_with_the_sampled_ids():
    record = EpisodeRecord(TOKENIZER)
    first = record.continuation("U:hi\nA:")
    assert first.chain is None and first.prompt_ids == ids("U:hi\nA:")
    record.record(first, [(ids("ab") + [EOS], [-0.1, -0.2, -0.3], True)])
    second = record.continuation("U:hi\nA:ab<eos>\nU:more\nA:")
    assert second.chain == 0 and second.prompt_ids == ids("U:hi\nA:ab") + [EOS] + ids("\nU:more\nA:")
    record.record(second, [(ids("c") + [EOS], [-0.4, -0.5], False)])
    chain = record.trained()
    assert chain is not None and len(record.chains) == 1 and record.rewrites == 0 and record.calls == 2
    assert chain.prompt_ids == ids("U:hi\nA:")
    assert chain.tokens == ids("ab") + [EOS] + ids("\nU:more\nA:") + ids("c") + [EOS]
    assert chain.sampled == [True] * 3 + [False] * 10 + [True] * 2
    assert chain.logprobs == [-0.1, -0.2, -0.3] + [0.0] * 10 + [-0.4, -0.5]
    assert not chain.finished


def test_a_call_that_rewrites_history_starts_a_new_sequence_and_is_counted():
    record = EpisodeRecord(TOKENIZER)
    first = record.continuation("U:hi\nA:")
    record.record(first, [(ids("ab") + [EOS], [-0.1] * 3, True)])
    # The reply re-rendered without its stop token: the text no longer starts with what was sampled.
    rewritten = record.continuation("U:hi\nA:ab\nU:more\nA:")
    assert rewritten.chain is None and rewritten.prompt_ids == ids("U:hi\nA:ab\nU:more\nA:")
    record.record(rewritten, [(ids("z") + [EOS], [-0.2] * 2, True)])
    assert record.rewrites == 1 and len(record.chains) == 2
    assert record.trained() is record.chains[1] and record.chains[1].tokens == ids("z") + [EOS]


def test_n_replies_of_one_call_fork_the_sequence():
    record = EpisodeRecord(TOKENIZER)
    first = record.continuation("U:hi\nA:")
    record.record(first, [(ids("a") + [EOS], [-0.1] * 2, True), (ids("b") + [EOS], [-0.2] * 2, True)])
    assert [c.tokens for c in record.chains] == [ids("a") + [EOS], ids("b") + [EOS]] and record.rewrites == 0
    # The agent goes on from the second choice: that fork is continued, not rewritten.
    nxt = record.continuation("U:hi\nA:b<eos>\nU:go\nA:")
    assert nxt.chain == 1


def test_a_call_that_goes_on_from_an_earlier_reply_forks_there():
    """Calls in flight together, or an agent that retries from an earlier point: not a rewrite."""
    record = EpisodeRecord(TOKENIZER)
    record.record(record.continuation("U:hi\nA:"), [(ids("a") + [EOS], [-0.1] * 2, True)])
    record.record(record.continuation("U:hi\nA:a<eos>\nU:x\nA:"), [(ids("b") + [EOS], [-0.2] * 2, True)])
    fork = record.continuation("U:hi\nA:a<eos>\nU:y\nA:")
    assert fork.chain == 0 and fork.prompt_ids == ids("U:hi\nA:a") + [EOS] + ids("\nU:y\nA:")
    record.record(fork, [(ids("c") + [EOS], [-0.3] * 2, True)])
    assert record.rewrites == 0 and len(record.chains) == 2 and record.trained() is record.chains[1]
    assert record.chains[0].tokens == ids("a") + [EOS] + ids("\nU:x\nA:") + ids("b") + [EOS]  # kept whole
    assert record.chains[1].tokens == ids("a") + [EOS] + ids("\nU:y\nA:") + ids("c") + [EOS]
    assert record.chains[1].sampled == [True, True] + [False] * 7 + [True, True]


def test_a_reply_is_cut_after_the_token_that_completes_a_stop_string():
    reply = cut_reply(TOKENIZER, ids("abXYcd") + [EOS], [-0.1] * 7, True, [EOS], ["XY"])
    assert reply.ids == ids("abXY") and reply.logprobs == [-0.1] * 4 and reply.text == "ab" and reply.finished
    whole = cut_reply(TOKENIZER, ids("abcd"), [-0.1] * 4, False, [EOS], ["XY"])
    assert whole.ids == ids("abcd") and whole.text == "abcd" and not whole.finished


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream=True is not supported"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs=True is not supported"),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "response_format="),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice='required'"),
        ({"messages": [{"role": "user", "content": "x"}], "best_of": 2}, "does not support the parameter(s) ['best_of']"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n=0"),
    ],
)
def test_what_the_endpoint_cannot_serve_is_a_400_naming_it(body, message):
    with pytest.raises(ApiError) as exc:
        parse_chat_request(body)
    assert exc.value.status == 400 and message in exc.value.message


def test_hundreds_of_agents_connecting_at_once_are_all_queued_for_the_endpoint():
    """The endpoint's listening socket queues every connection of a burst while its accepting
    thread lags (stopped here): none is dropped, so no agent fails with a connection error."""
    endpoint = AgentEndpoint(timeout_s=30.0)
    clients = []
    try:
        endpoint.server.shutdown()  # the accept loop stops; the socket keeps listening
        for _ in range(300):
            client = socket.socket()
            client.setblocking(False)
            client.connect_ex(("127.0.0.1", endpoint.port))
            clients.append(client)
        deadline, waiting = time.monotonic() + 2.0, set(clients)
        while waiting and time.monotonic() < deadline:
            _, writable, _ = select.select([], list(waiting), [], 0.1)
            waiting -= {c for c in writable if c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0}
        assert not waiting, f"{len(waiting)} of 300 connections were not queued"
    finally:
        for client in clients:
            client.close()
        endpoint.close()


def test_requests_of_an_unknown_or_ended_episode_are_refused_without_waiting():
    endpoint = AgentEndpoint(timeout_s=30.0)
    try:
        (key,) = endpoint.open_phase(1, time.monotonic() + 60)
        body = json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}]}).encode()
        endpoint.close_phase()
        for url in (endpoint.base_url(key), endpoint.base_url("not-a-key")):
            request = urllib.request.Request(url + "/chat/completions", data=body, method="POST")
            with pytest.raises(urllib.error.HTTPError) as exc:
                urllib.request.urlopen(request, timeout=10)
            assert exc.value.code == 410 and "ended" in json.loads(exc.value.read())["error"]["message"]
    finally:
        endpoint.close()


def test_requests_of_an_episode_past_its_timeout_are_refused():
    endpoint = AgentEndpoint(timeout_s=0.2)
    try:
        (key,) = endpoint.open_phase(1, time.monotonic() + 60)
        start = urllib.request.Request(endpoint.base_url(key).rsplit("/v1", 1)[0] + "/start", data=b"{}", method="POST")
        urllib.request.urlopen(start, timeout=10).read()
        time.sleep(0.3)
        body = json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}]}).encode()
        request = urllib.request.Request(endpoint.base_url(key) + "/chat/completions", data=body, method="POST")
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(request, timeout=10)
        assert exc.value.code == 410 and "ran past env.timeout_s=0.2 s" in json.loads(exc.value.read())["error"]["message"]
    finally:
        endpoint.close()


# --- episodes end to end (workers, endpoint, openai client) ------------------------------------


def test_an_agent_that_talks_twice_trains_one_sequence_of_exactly_the_served_ids(agents):
    calls: list = []
    played = play(f"{agents}:talk", calls=calls)
    c0, c1 = played.completions
    prompt = ids("U:p0|\nA:")
    assert c0.prompt_ids == prompt
    assert c0.token_ids == ids("ab") + [EOS] + ids("\nU:again\nA:") + ids("ab") + [EOS]
    assert c0.sampled == [True] * 3 + [False] * 11 + [True] * 3
    assert c0.logprobs == [-0.1, -0.2, -0.3] + [0.0] * 11 + [-0.1, -0.2, -0.3]
    assert played.returns == [3.0, 3.0] and played.named == {"bonus": [1.0, 1.0], "length": [2.0, 2.0]}
    assert played.turns == 4.0 and played.counts == {"history_rewrites": 0.0, "no_calls": 0.0}
    assert played.failures.timeouts == played.failures.errors == 0
    # The second call's prompt given to the engine was the first's ids and reply as sampled.
    second_prompts = [p for prompts, s in calls for p in prompts if s.max_new_tokens == 8]
    assert prompt + c0.token_ids[:14] in second_prompts
    assert {s.temperature for _, s in calls} == {1.0, 0.5}  # the agent's own temperature, the run's where it set none


# TEMPLATE with a Qwen3-like rule: an assistant turn followed by more messages loses its thinking block.
DROPS_THINKING = TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'].split('</think>')[-1] if not loop.last else m['content'] }}")


def test_a_template_that_drops_earlier_thinking_renders_the_next_call_so_and_both_replies_train_as_sampled(agents):
    def thinks(prompts: list[list[int]], sampling: SamplingSettings, images: list | None = None) -> list[Completion]:
        reply = ids("<think>hm</think>ab") + [EOS]
        return [Completion(i, reply, [-(j + 1) / 10 for j in range(len(reply))], True) for i in range(len(prompts))]

    runner = AgentRunner(AgentEnvConfig(agent=f"{agents}:talk", chat_template=DROPS_THINKING), RewardConfig(), TOKENIZER, 64, 64, 600)
    try:
        played = runner.run(rows("p0"), 1, SamplingSettings(stop_token_ids=[EOS]), "train-0", thinks)
    finally:
        runner.close()
    reply = ids("<think>hm</think>ab") + [EOS]
    (last,), (first,) = played.completions, played.extra
    # The second call's prompt is the template's: the first reply without its thinking, not as sampled.
    assert last.prompt_ids == ids("U:p0|\nA:ab") + [EOS] + ids("\nU:again\nA:")
    assert last.token_ids == reply and last.sampled == [True] * len(reply)
    # The first reply trains where it was sampled: its own sequence, with the episode's reward.
    assert first.prompt_ids == ids("U:p0|\nA:") and first.token_ids == reply and first.sampled == [True] * len(reply)
    assert first.logprobs == [-(j + 1) / 10 for j in range(len(reply))]
    assert played.extra_episode == [0] and played.counts["history_rewrites"] == 1.0


def test_a_conversational_row_reaches_the_agent_as_its_messages(agents):
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    row = PromptRow(ids("ignored"), "ignored", {"tag": "c"}, True, messages)
    runner = AgentRunner(AgentEnvConfig(agent=f"{agents}:conversational", chat_template=TEMPLATE), RewardConfig(), TOKENIZER, 64, 64, 600)
    try:
        played = runner.run([row], 1, SamplingSettings(stop_token_ids=[EOS]), "train-0", scripted_generate([]))
    finally:
        runner.close()
    assert played.returns == [1.0] and played.completions[0].prompt_ids == ids("S:s\nU:q\nA:")


def test_an_async_agent_gets_an_async_client(agents):
    played = play(f"{agents}:talk_async", tags=("p0",), copies=2)
    assert played.returns == [2.0, 2.0] and [c.sampled for c in played.completions] == [[True] * 3] * 2


def test_a_rewritten_history_starts_a_new_sequence_and_both_train_with_the_episode(agents):
    played = play(f"{agents}:rewrite")
    assert played.counts["history_rewrites"] == 2.0 and played.returns == [1.0, 1.0]
    # The episode's last reply's sequence first (one per episode), then the ones it left behind.
    assert [c.prompt_ids for c in played.completions] == [ids("U:summary\nA:")] * 2
    assert [c.prompt_ids for c in played.extra] == [ids("U:p0|\nA:"), ids("U:p1|\nA:")] and played.extra_episode == [0, 1]
    sequences, episode_of = played.sequences()
    assert len(sequences) == 4 and episode_of == [0, 1, 0, 1]
    assert all(c.sampled == [True] * 3 for c in sequences)


def test_tool_calls_come_back_in_openai_form(agents):
    played = play(f"{agents}:tools")
    assert played.returns == [1.0, 1.0] and played.tool_calls == 2.0


def test_an_agent_with_its_own_client_finds_the_endpoint_in_its_environment(agents):
    assert play(f"{agents}:own_client").returns == [1.0, 1.0]


def test_an_unsupported_parameter_is_refused_and_the_episode_goes_on(agents):
    assert play(f"{agents}:streams").returns == [1.0, 1.0]


@pytest.mark.parametrize("agent", ["barrier", "barrier_async"])
def test_episodes_run_at_once_in_one_worker_each_with_its_own_environment(agents, tmp_path, agent):
    """Six episodes on one worker pass a barrier only if they run at once; each then builds its
    client from OPENAI_BASE_URL / OPENAI_API_KEY and is served as itself."""
    folder = tmp_path / "barrier"
    folder.mkdir()
    tags = [f"e{i}" for i in range(6)]
    episodes = [PromptRow(ids(f"{t}|"), f"{t}|", {"tag": t, "folder": str(folder), "parties": len(tags)}) for t in tags]
    env = AgentEnvConfig(agent=f"{agents}:{agent}", workers=1, max_concurrency=6, chat_template=TEMPLATE)
    runner = AgentRunner(env, RewardConfig(), TOKENIZER, 64, 64, 600)
    try:
        played = runner.run(episodes, 1, SamplingSettings(stop_token_ids=[EOS], seed=5), "train-0", scripted_generate([]))
    finally:
        runner.close()
    assert played.returns == [1.0] * 6 and played.failures.errors == 0
    assert [c.prompt_ids for c in played.completions] == [ids(f"U:{t}\nA:") for t in tags]


def test_a_hung_crashing_silent_or_nonsense_agent_fails_its_episode_only(agents):
    reward = RewardConfig(on_failure=-1.0, max_failure_frac=1.0)
    started = time.monotonic()
    played = play(f"{agents}:by_tag", tags=("hang", "raise", "crash", "silent", "nonsense", "ok"), reward=reward, timeout_s=3.0)
    assert time.monotonic() - started < 60
    assert played.returns == [-1.0, -1.0, -1.0, -1.0, -1.0, 1.0]
    assert played.failures.timeouts == 1 and played.failures.errors == 4 and played.counts["no_calls"] == 1.0
    hung = played.completions[0]  # the reply it was served before it hung is kept (scored reward.on_failure)
    assert hung.prompt_ids == ids("U:hang\nA:") and hung.sampled == [True] * 3
    silent = played.completions[3]  # never called: one stop token, not sampled, after the row's prompt
    assert silent.prompt_ids is None and silent.token_ids == [EOS] and silent.sampled == [False]


@pytest.mark.parametrize("agent", ["blocks_its_loop", "blocks_its_thread"])
def test_an_agent_blocked_on_one_prompt_in_eight_costs_those_episodes_only(agents, agent):
    """The default step's shape (64 prompts x 8 episodes, the default env.workers and
    env.max_concurrency), every episode of one prompt in eight blocked for good (its event loop, or
    the synchronous agent's thread), env.timeout_s=5: those 64 time out (`env/timeouts`), the 448
    others score as they would without them, and the step ends within env.timeout_s of the time
    its other episodes need (docs/agents.md, "Isolation")."""
    tags = ["block" if i % 8 == 0 else f"e{i}" for i in range(64)]
    default = AgentEnvConfig(agent=f"{agents}:{agent}")
    reward = RewardConfig(on_failure=-1.0)  # the default reward.max_failure_frac: the run goes on
    started = time.monotonic()
    played = play(
        f"{agents}:{agent}", tags=tags, copies=8, reward=reward, timeout_s=5.0, workers=default.workers,
        max_concurrency=default.max_concurrency,
    )
    elapsed = time.monotonic() - started
    assert played.returns == [-1.0 if t == "block" else 1.0 for t in tags for _ in range(8)]
    assert played.failures.timeouts == 64 and played.failures.errors == 0
    innocent = [c.prompt_ids for c in played.completions if c.prompt_ids]
    assert innocent == [ids(f"U:{t}|\nA:") for t in tags if t != "block" for _ in range(8)]
    assert elapsed < 5.0 + 25.0, elapsed  # env.timeout_s, the other episodes' own time and the workers' start (docs/agents.md)


def test_too_many_failed_episodes_stop_the_run_naming_the_agent(agents):
    with pytest.raises(UserError, match=r"the agent 'agent_fixtures:by_tag' failed on 2 of this rank's 2 episodes"):
        play(f"{agents}:by_tag", tags=("raise", "silent"))


def test_an_episode_that_forks_trains_each_fork(agents, tmp_path):
    (tmp_path / "forks.py").write_text(textwrap.dedent('''
        def run(client, row):
            client.chat.completions.create(model="x", messages=[{"role": "user", "content": row["prompt"]}], n=3)
            return 1.0
    '''))
    played = play("forks:run", tags=("p0",))
    assert len(played.completions) == 1 and len(played.extra) == 2 and played.extra_episode == [0, 0]
    assert played.counts["history_rewrites"] == 0.0  # forks are not rewrites


def test_an_agent_batch_survives_a_checkpoint_as_json_exactly(agents):
    """An asynchronous run's checkpoint holds played batches (rltrain/algos/rl/async_rollouts.py): every
    sequence of an agent's episodes (prompt ids, masks, log-probabilities, the episode of each), its
    named rewards and counts come back as they were."""
    from rltrain.envs.agent.runner import AgentResults, played_from_json, played_to_json

    for agent in ("rewrite", "talk"):
        played = play(f"{agents}:{agent}")
        back = played_from_json(json.loads(json.dumps(played_to_json(played))))
        assert isinstance(back, AgentResults) and back == played
        assert back.sequences() == played.sequences()
        assert all(c.prompt_ids is not None for c in back.sequences()[0])


def test_a_phase_samples_with_seeds_of_its_own_calls_only_and_replies_keep_their_version(agents):
    """A resumed run plays a phase as the uninterrupted one did (the seeds do not count the calls of
    earlier phases), and each sequence carries the policy version the engine reported for it."""
    env = AgentEnvConfig(agent=f"{agents}:talk", workers=1, max_concurrency=1, chat_template=TEMPLATE)
    runner = AgentRunner(env, RewardConfig(), TOKENIZER, 64, 64, 600)
    scripted = scripted_generate([])
    seeds: list[list[int]] = []

    def generate(prompts, sampling, images=None):
        seeds[-1].append(sampling.seed)
        return [replace(c, version=7) for c in scripted(prompts, sampling)]

    try:
        for _ in range(2):
            seeds.append([])
            played = runner.run(rows("p0", "p1"), 1, SamplingSettings(stop_token_ids=[EOS], seed=5), "train-0", generate)
            assert [c.version for c in played.completions] == [7, 7]
    finally:
        runner.close()
    assert seeds[0] == seeds[1] == [5 + TURN_SEED_STRIDE * i for i in range(4)]
