"""`env=tools` (rltrain/envs/tools.py): schemas from type hints and docstrings, prompts that offer the
tools, tool calls read from replies, and episodes whose tool calls run in real, killable workers:
a hung tool or a raising one becomes an error observation and is counted, the episode goes on. The
engine is the scripted stand-in of test_episodes.py; the tools and their workers are real."""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field

import pytest
from test_episodes import EOS, TOKENIZER, ids, rows, scripted_generate

from rltrain.config.schema import DataConfig
from rltrain.data.prompt_data import build_prompt_data
from rltrain.envs.episodes import EpisodeRunner
from rltrain.envs.tools import CallTools, ToolCall, ToolPrompts, parse_tool_calls, tool_schemas
from rltrain.models.tokenizer import build_char_tokenizer
from rltrain.rollout.base import SamplingSettings
from rltrain.runtime.errors import UserError

TOOLS = textwrap.dedent('''
    import time

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first addend
            b: the second addend
        """
        return a + b

    def hang() -> str:
        """Never returns."""
        time.sleep(1000)
        return "late"

    def boom(x: str) -> str:
        """Always raises.

        Args:
            x: anything
        """
        raise ValueError(f"cannot {x}")

    def undocumented(a: int) -> int:
        return a
''')


@pytest.fixture
def tools_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "tool_fixtures.py").write_text(TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "tool_fixtures"


@dataclass
class ToolsCfg:
    tools: list[str]
    describe_tools: bool = True
    max_turns: int = 4
    max_tokens_per_turn: int | None = None
    max_total_tokens: int = 400
    timeout_s: float | None = 1.0
    workers: int = 1
    max_concurrency: int = 256
    cls: str | None = None


@dataclass
class RewardCfg:
    on_failure: float = 0.0
    max_failure_frac: float = 0.25
    fns: list = field(default_factory=list)


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_schemas_come_from_type_hints_and_docstrings_and_a_tool_without_them_is_refused(tools_module):
    names, schemas = tool_schemas([f"{tools_module}:add", f"{tools_module}:hang"])
    assert names == {"add": f"{tools_module}:add", "hang": f"{tools_module}:hang"}
    add = schemas[0]["function"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first addend"}
    assert add["parameters"]["required"] == ["a", "b"]
    with pytest.raises(UserError, match=r"'tool_fixtures:undocumented'.*type hint and a line under 'Args:'"):
        tool_schemas([f"{tools_module}:undocumented"])
    with pytest.raises(UserError, match="names two functions 'add'"):
        tool_schemas([f"{tools_module}:add", f"{tools_module}:add"])
    with pytest.raises(UserError, match="could not be loaded"):
        tool_schemas([f"{tools_module}:missing"])


def test_tool_calls_are_read_in_the_hermes_format():
    assert parse_tool_calls("the answer is 5") == []
    assert parse_tool_calls(call("add", a=1, b=2) + " then " + call("hang")) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("hang", {})]
    as_string = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse_tool_calls(as_string) == [ToolCall("add", {"a": 1})]
    assert parse_tool_calls('<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>') == [ToolCall("add", {"a": 1})]
    (bad,) = parse_tool_calls("<tool_call>{add(1, 2)}</tool_call>")
    assert bad.arguments is None and "not JSON" in bad.problem
    (cut,) = parse_tool_calls('<tool_call>{"name": "add", "argu')
    assert cut.arguments is None and "cut off" in cut.problem
    (not_object,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>')
    assert not_object.arguments is None and "must be an object" in not_object.problem


def test_a_tokenizer_with_a_response_template_parses_calls_its_own_way():
    """The tokenizer's own parser (transformers' `parse_response`) decides; a stand-in for it here."""

    class Parsing:
        response_template = {"stand-in": True}

        def parse_response(self, text, prefix, tools):
            assert prefix == "" and tools == ["schema"]
            return {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": text, "arguments": {"a": 1}}}]}

    assert parse_tool_calls("add", Parsing(), ["schema"]) == [ToolCall("add", {"a": 1})]


def test_prompts_offer_the_tools_as_text_as_a_system_message_or_through_a_template_that_renders_them(tools_module):
    _, schemas = tool_schemas([f"{tools_module}:add"])
    plain = ToolPrompts(TOKENIZER, schemas, describe=True)
    text = plain.text("2+3=")
    assert text.startswith("Tools you can call:\n" + json.dumps(schemas[0]["function"])) and text.endswith("\n\n2+3=")
    assert ToolPrompts(TOKENIZER, schemas, describe=False).text("2+3=") == "2+3="
    # The char tokenizer's template does not render tools: the listing becomes a system message.
    chat = plain.chat([{"role": "user", "content": "2+3?"}])
    assert chat.startswith("S:Tools you can call:") and chat.endswith("U:2+3?\nA:")
    with_tools = build_char_tokenizer()
    with_tools.chat_template = (
        "{% if tools %}T:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}A:{% endif %}"
    )
    assert ToolPrompts(with_tools, schemas, describe=True).chat([{"role": "user", "content": "2+3?"}]) == "T:add;U:2+3?\nA:"  # jinja trims the newline after a block


def test_build_prompt_data_renders_every_prompt_with_the_tools(tools_module):
    _, schemas = tool_schemas([f"{tools_module}:add"])
    data = DataConfig(num_train=8, num_eval=2, max_length=512)
    train, evals, dropped = build_prompt_data(TOKENIZER, data, 0, ToolPrompts(TOKENIZER, schemas, describe=True))
    assert dropped == 0 and len(train) == 8 and len(evals) == 2
    assert all(r.text.startswith("Tools you can call:") and r.ids == ids(r.text) and not r.chat for r in train + evals)
    with pytest.raises(UserError, match="env.describe_tools=false"):
        build_prompt_data(TOKENIZER, DataConfig(num_train=8, num_eval=2, max_length=20), 0, ToolPrompts(TOKENIZER, schemas, True))


SCRIPT = {
    # a call, its result read back, the answer
    "p0": [call("add", a=2, b=3), "5"],
    # a tool that hangs: killed after env.timeout_s, an error observation, the episode goes on
    "p1": [call("hang"), "?"],
    # a raising tool, an unknown tool and an unreadable call in one reply, then the answer
    "p2": [call("boom", x="fly") + call("nope") + "<tool_call>{oops}</tool_call>", "done"],
    # no call at all: the first reply is the answer
    "p3": ["7"],
}


def tool_runner(tools_module: str, **cfg) -> EpisodeRunner:
    env_cfg = ToolsCfg([f"{tools_module}:{t}" for t in ("add", "hang", "boom")], **cfg)
    return EpisodeRunner(env_cfg, RewardCfg(), TOKENIZER, 200, 600, CallTools(env_cfg, TOKENIZER))


def test_an_episode_runs_its_tool_calls_in_workers_and_every_failure_is_an_observation(tools_module, monkeypatch):
    monkeypatch.setattr("test_episodes.SCRIPT", SCRIPT)
    runner = tool_runner(tools_module)
    try:
        played = runner.run(rows("p0", "p1", "p2", "p3"), 1, SamplingSettings(stop_token_ids=[EOS]), "train-0", scripted_generate([]))
    finally:
        runner.close()
    c0, c1, c2, c3 = played.completions
    first = ids(call("add", a=2, b=3)) + [EOS]
    assert c0.token_ids == first + ids("<tool_response>5</tool_response>") + ids("5") + [EOS]
    assert c0.sampled == [True] * len(first) + [False] * len(ids("<tool_response>5</tool_response>")) + [True] * 2
    assert c1.token_ids[-len(ids("?")) - 1 :] == ids("?") + [EOS]
    assert "<tool_response>error: hang did not return within env.timeout_s=1 s</tool_response>" in TOKENIZER.decode(c1.token_ids)
    text2 = TOKENIZER.decode(c2.token_ids)
    assert "<tool_response>error: ValueError: cannot fly</tool_response>" in text2
    assert "<tool_response>error: there is no tool 'nope'; the tools are add, hang, boom</tool_response>" in text2
    assert "error: the tool call is not JSON" in text2
    assert c3.token_ids == ids("7") + [EOS] and c3.sampled == [True] * 2
    assert all(c.finished for c in played.completions)  # every episode ended with an answer
    assert played.final_texts == ["5", "?", "done", "7"]
    assert played.tool_calls == 1 + 1 + 3 + 0 and played.turns == 2 + 2 + 2 + 1
    assert played.failures.timeouts == 1 and played.failures.errors == 1  # the model's unreadable calls are not the tool's failures
    assert played.returns == [0.0] * 4  # tools give no reward: reward.fns score the answers


def test_tool_results_go_through_a_chat_template_that_renders_tools(tools_module, monkeypatch):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}R:{{ m['name'] }}={{ m['content'] }}\n"
        "{% else %}{{ m['role'][0] | upper }}:{{ m['content'] }}\n{% endif %}{% endfor %}"
        "{% if tools %}{% endif %}{% if add_generation_prompt %}A:{% endif %}"
    )
    monkeypatch.setattr("test_episodes.SCRIPT", SCRIPT)
    env_cfg = ToolsCfg([f"{tools_module}:add"])
    runner = EpisodeRunner(env_cfg, RewardCfg(), tokenizer, 120, 600, CallTools(env_cfg, tokenizer))
    try:
        (row,) = rows("p0")
        row.chat = True
        played = runner.run([row], 1, SamplingSettings(stop_token_ids=[EOS]), "train-0", scripted_generate([]))
    finally:
        runner.close()
    assert played.completions[0].token_ids == ids(call("add", a=2, b=3)) + [EOS] + ids("R:add=5\nA:") + ids("5") + [EOS]
