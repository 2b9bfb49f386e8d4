"""Multi-turn episodes (rltrain/envs): token in, token out; the environment's calls bounded in real
worker processes; a killed worker's episodes rebuilt by replay. The engine is a scripted stand-in
(a function of the ids it is given), the environments and their workers are real."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

import pytest

from rltrain.data.prompt_data import PromptRow
from rltrain.envs.episodes import EpisodeRunner
from rltrain.envs.observations import ObservationRenderer
from rltrain.envs.user_env import HostedEnvironments
from rltrain.models.tokenizer import build_char_tokenizer
from rltrain.rollout.base import Completion, SamplingSettings
from rltrain.runtime.errors import UserError

ENVS = textwrap.dedent('''
    import time

    class Countdown:
        """' go:' first; two steps; each step's reward is the number of 'a' in the reply."""
        def reset(self, **row):
            self.k = 0
            self.tag = row["tag"]
            return " go:"

        def step(self, text):
            self.k += 1
            reward = float(text.count("a"))
            return (None, reward, True) if self.k >= 2 else (f" n{self.k}:", reward, False)

    class HangsOnX(Countdown):
        def step(self, text):
            if "x" in text:
                time.sleep(1000)
            return super().step(text)

    class RaisesOnX(Countdown):
        def step(self, text):
            if "x" in text:
                raise KeyError("no such thing")
            return super().step(text)

    class SlowSteps(Countdown):
        def step(self, text):
            time.sleep(1.5)
            return super().step(text)

    class Messages(Countdown):
        def step(self, text):
            observation, reward, done = super().step(text)
            return ([{"role": "user", "content": observation}] if observation else None), reward, done

    class SilentMessages(Messages):
        """No first observation: the first reply opens the episode."""
        def reset(self, **row):
            super().reset(**row)
            return None
''')

# What the scripted model replies to each prompt (by its tag), turn by turn.
SCRIPT = {"p0": ["aa", "a"], "p1": ["xa", "aaa"], "p2": ["b", "aa"]}


@dataclass
class EnvCfg:
    cls: str
    max_turns: int = 4
    max_tokens_per_turn: int | None = None
    max_total_tokens: int = 64
    timeout_s: float | None = 2.0
    workers: int = 1
    max_concurrency: int = 256


@dataclass
class RewardCfg:
    on_failure: float = -1.0
    max_failure_frac: float = 0.5


@pytest.fixture
def envs_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "env_fixtures.py").write_text(ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "env_fixtures"


TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id


def scripted_generate(calls: list[list[list[int]]]):
    """The engine stand-in: replies SCRIPT[tag][turn] + EOS, the turn read from the ids so far
    (how many model replies they hold); logprob of the j-th reply token -(j + 1) / 10."""

    def generate(prompts: list[list[int]], sampling: SamplingSettings, images: list | None = None) -> list[Completion]:
        assert sampling.n == 1
        calls.append([list(p) for p in prompts])
        out = []
        for i, ids in enumerate(prompts):
            text = TOKENIZER.decode(ids)
            tag = text.split("|")[0]
            reply = SCRIPT[tag][ids.count(EOS)]
            reply_ids = TOKENIZER(reply, add_special_tokens=False)["input_ids"][: sampling.max_new_tokens - 1] + [EOS]
            out.append(Completion(i, reply_ids, [-(j + 1) / 10 for j in range(len(reply_ids))], True))
        return out

    return generate


def rows(*tags: str) -> list[PromptRow]:
    return [PromptRow(TOKENIZER(f"{t}|", add_special_tokens=False)["input_ids"], f"{t}|", {"tag": t}) for t in tags]


def hosted_runner(env_cfg: EnvCfg, reward_cfg: RewardCfg, collective_timeout_s: float = 600) -> EpisodeRunner:
    steps = HostedEnvironments(env_cfg, reward_cfg, TOKENIZER)
    return EpisodeRunner(env_cfg, reward_cfg, TOKENIZER, 16, collective_timeout_s, steps)


def run(module: str, cls: str, tags=("p0", "p2"), copies: int = 1, calls=None, **env):
    runner = hosted_runner(EnvCfg(f"{module}:{cls}", **env), RewardCfg())
    try:
        sampling = SamplingSettings(n=copies, stop_token_ids=[EOS])
        return runner.run(rows(*tags), copies, sampling, "train-0", scripted_generate(calls if calls is not None else []))
    finally:
        runner.close()


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def test_an_episode_is_exactly_the_sampled_ids_and_the_tokenized_observations(envs_module):
    calls: list = []
    played = run(envs_module, "Countdown", calls=calls)
    c0, c2 = played.completions
    # reset's observation, reply 1, step 1's observation, reply 2 (the environment ends it)
    assert c0.token_ids == ids(" go:") + ids("aa") + [EOS] + ids(" n1:") + ids("a") + [EOS]
    assert c0.sampled == [False] * 4 + [True] * 3 + [False] * 4 + [True] * 2
    assert c0.logprobs == [0.0] * 4 + [-0.1, -0.2, -0.3] + [0.0] * 4 + [-0.1, -0.2]
    assert c0.finished and c2.finished
    assert played.returns == [3.0, 2.0] and played.turns == 4.0
    assert played.failures.timeouts == played.failures.errors == 0
    # Each turn the engine was given the prompt's ids and the episode's ids so far, nothing re-rendered.
    assert calls[1][0] == ids("p0|") + c0.token_ids[:11]


def test_a_chat_template_that_is_not_append_only_never_changes_a_sampled_id(envs_module):
    """A template that renders earlier turns differently once more follow (here only the last
    message ends with '.') would re-tokenize the model's replies if the conversation were re-templated;
    an episode keeps the sampled ids, and chat-message observations are refused by name for it."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }}{% if loop.last %}{{ '.' }}{% else %}"
        "{{ '\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '\\nA:' }}{% endif %}"
    )
    played = run(envs_module, "Countdown")
    sampled = [t for t, s in zip(played.completions[0].token_ids, played.completions[0].sampled, strict=True) if s]
    assert sampled == ids("aa") + [EOS] + ids("a") + [EOS]  # turn by turn, as the engine sampled them
    chat = [{"role": "user", "content": "p0| go:"}, {"role": "assistant", "content": "aa"}]
    once = tokenizer.apply_chat_template(chat, tokenize=False)
    more = tokenizer.apply_chat_template([*chat, {"role": "user", "content": " n1:"}], tokenize=False)
    assert not more.startswith(once)  # re-templating would have changed the tokens after "aa"
    with pytest.raises(UserError, match="renders a conversation differently"):
        ObservationRenderer(tokenizer).render([{"role": "user", "content": " n1:"}], "Env.step()", chat=True)


def test_chat_message_observations_are_the_templates_continuation(envs_module):
    played = run(envs_module, "Messages")
    # The char tokenizer's template: "U:<content>\n" per user message, then the generation prompt "A:".
    assert played.completions[0].token_ids == ids(" go:") + ids("aa") + [EOS] + ids("U: n1:\nA:") + ids("a") + [EOS]
    assert played.returns == [3.0, 2.0]


def test_a_hung_step_costs_its_episode_and_the_killed_workers_episodes_are_rebuilt(envs_module):
    """p1's first reply hangs its step: the worker is killed after env.timeout_s, p1 scores
    reward.on_failure and is counted; p0 and p2, whose environments died with that worker, are
    rebuilt by replay in the new one and end exactly as in a run where nothing hung."""
    clean = run(envs_module, "Countdown", tags=("p0", "p2"))
    hung = run(envs_module, "HangsOnX", tags=("p0", "p1", "p2"), timeout_s=1.0)
    assert hung.failures.timeouts == 1 and hung.failures.errors == 0
    assert hung.returns == [clean.returns[0], -1.0, clean.returns[1]]
    assert [c.token_ids for c in (hung.completions[0], hung.completions[2])] == [c.token_ids for c in clean.completions]
    assert not hung.completions[1].finished


def test_a_raising_step_is_counted_and_too_many_failures_stop_with_the_class_named(envs_module):
    played = run(envs_module, "RaisesOnX", tags=("p0", "p1", "p2"))
    assert played.failures.errors == 1 and played.returns[1] == -1.0
    with pytest.raises(UserError, match=r"env_fixtures:RaisesOnX.*failed on 1 of this rank's 1 episodes"):
        run(envs_module, "RaisesOnX", tags=("p1",))


def test_the_token_budget_cuts_an_episode_at_max_total_tokens(envs_module):
    played = run(envs_module, "Countdown", tags=("p1",), max_total_tokens=6)
    (c,) = played.completions
    assert c.token_ids == ids(" go:") + ids("x") + [EOS]  # the reply had room for 2 tokens; no room for step 1's observation
    assert not c.finished and played.turns == 1.0


def test_every_turn_shares_one_deadline_so_slow_steps_never_outlast_half_the_collective_timeout(envs_module):
    """Each step takes 1.5 s, under env.timeout_s; with a 4 s collective timeout the phase has 2 s
    for all its environment calls: the second episode's first step and every later step expire."""
    import time

    runner = hosted_runner(EnvCfg(f"{envs_module}:SlowSteps", timeout_s=10.0), RewardCfg(max_failure_frac=1.0), 4.0)
    try:
        started = time.monotonic()
        played = runner.run(rows("p0", "p2"), 1, SamplingSettings(stop_token_ids=[EOS]), "train-0", scripted_generate([]))
        elapsed = time.monotonic() - started
    finally:
        runner.close()
    assert played.failures.timeouts == 2 and played.returns == [-1.0, -1.0]
    assert elapsed < 4.0, elapsed  # one 2 s budget for both turns, not 2 s per turn


def test_a_played_batch_survives_a_checkpoint_as_json_exactly(envs_module):
    """An asynchronous run's checkpoint holds played batches (rltrain/algos/rl/async_rollouts.py): the
    sampled masks, log-probabilities, returns, replies and counts come back as they were."""
    import json

    from rltrain.envs.episodes import results_from_json, results_to_json

    played = run(envs_module, "HangsOnX", tags=("p0", "p1", "p2"), timeout_s=1.0)
    back = results_from_json(json.loads(json.dumps(results_to_json(played))))
    assert back == played
    assert back.completions[0].sampled is not None and not all(back.completions[0].sampled)


# A Qwen3-like rule in a tiny template: an assistant turn followed by more messages is rendered
# without its thinking block (what precedes '</think>'); the last one as written.
DROPS_THINKING = (
    "{% for m in messages %}{{ m['role'][0] | upper }}:{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
    "{% if m['role'] == 'assistant' %}<eos>{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)


def by_call(replies: list[str], calls: list):
    """The engine stand-in for one episode: reply i of `replies` on call i, logprob -(j + 1) / 10."""

    def generate(prompts: list[list[int]], sampling: SamplingSettings, images: list | None = None) -> list[Completion]:
        calls.append([list(p) for p in prompts])
        reply_ids = ids(replies[len(calls) - 1]) + [EOS]
        return [Completion(0, reply_ids, [-(j + 1) / 10 for j in range(len(reply_ids))], True)]

    return generate


def play_with_template(envs_module: str, template: str, replies: list[str], calls: list, cls: str = "Messages"):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = template
    env_cfg, reward_cfg = EnvCfg(f"{envs_module}:{cls}"), RewardCfg()
    runner = EpisodeRunner(env_cfg, reward_cfg, tokenizer, 32, 600, HostedEnvironments(env_cfg, reward_cfg, tokenizer))
    try:
        return runner.run(rows("p0"), 1, SamplingSettings(stop_token_ids=[EOS]), "train-0", by_call(replies, calls))
    finally:
        runner.close()


def test_the_next_turn_sees_an_earlier_reply_as_the_template_renders_it_and_only_sampled_ids_train(envs_module):
    calls: list = []
    played = play_with_template(envs_module, DROPS_THINKING, ["<think>hm</think>aa", "a"], calls)
    (c,) = played.completions
    # Turn 2's prompt: the first reply as the template renders it once a message follows (no thinking),
    # then the observation and the generation prompt; not the ids sampled in turn 1.
    history = ids(" go:") + ids("aa") + [EOS] + ids("\nU: n1:\nA:")
    assert calls[1][0] == ids("p0|") + history
    assert c.token_ids == history + ids("a") + [EOS]
    # Trained in the episode's sequence: the second reply exactly as sampled, with its logprobs.
    assert c.sampled == [False] * len(history) + [True, True]
    assert c.logprobs == [0.0] * len(history) + [-0.1, -0.2]
    # The first reply trains in the sequence it was sampled in, an extra sequence of the same episode.
    first = ids("<think>hm</think>aa") + [EOS]
    (extra,) = played.extra
    assert played.extra_episode == [0] and played.sequences()[1] == [0, 0]
    assert extra.token_ids == ids(" go:") + first and calls[0][0] == ids("p0|") + ids(" go:")
    assert extra.sampled == [False] * 4 + [True] * len(first)
    assert extra.logprobs == [0.0] * 4 + [-(j + 1) / 10 for j in range(len(first))]
    assert played.returns == [3.0]  # the environment scored the replies as sampled (2 + 1 'a')


def test_a_reply_the_template_keeps_as_written_stays_sampled_and_trained(envs_module):
    calls: list = []
    played = play_with_template(envs_module, DROPS_THINKING, ["aa", "a"], calls)
    (c,) = played.completions
    first = ids("aa") + [EOS]
    assert c.token_ids == ids(" go:") + first + ids("U: n1:\nA:") + ids("a") + [EOS]
    assert [t for t, s in zip(c.token_ids, c.sampled, strict=True) if s] == first + ids("a") + [EOS]
    assert played.extra == []


def test_a_rewritten_first_reply_keeps_its_own_sequence_whole(envs_module):
    """The reply at the episode's start (no first observation) is cut from the episode's ids while
    its extra sequence keeps every one of them."""
    calls: list = []
    played = play_with_template(envs_module, DROPS_THINKING, ["<think>hm</think>aa", "a"], calls, cls="SilentMessages")
    (c,), (extra,) = played.completions, played.extra
    first = ids("<think>hm</think>aa") + [EOS]
    assert extra.token_ids == first and extra.sampled == [True] * len(first)
    assert c.token_ids == ids("aa") + [EOS] + ids("\nU: n1:\nA:") + ids("a") + [EOS]
    assert len(c.sampled) == len(c.token_ids) == len(c.logprobs)
