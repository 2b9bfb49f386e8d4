"""`env=tools`: typed Python functions offered to the model as tools, called in killable workers.

Schemas come from type hints and docstrings (transformers' `get_json_schema`). A chat prompt whose
template renders tools gets them that way; any other prompt a plain-text listing. Calls are read
with the tokenizer's `response_template` where it has one, else in the Hermes format most templates
use (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`). Each result, or an error text, is
the next observation (an image, or a list of text and images, as image parts: docs/vision.md); a
reply that calls no tool is the answer `reward.fns` score. docs/environments.md, "Tools".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from rltrain.config.group_options import EnvConfig
from rltrain.envs.episodes import Episode
from rltrain.envs.observations import ObservationRenderer, segment_part
from rltrain.envs.wire import from_wire, is_image
from rltrain.runtime.call_pool import Call, CallPool, CallResult
from rltrain.runtime.errors import UserError
from rltrain.runtime.user_code import load_callable

CALL_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
CALL_TOOL = "rltrain.envs.wire:call_tool"
# What the model reads back from one call: text, or text and images in order.
Content = str | list


def tool_schemas(paths: list[str]) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """(tool name -> its `package.module:function`, the tools' JSON schemas in the order given)."""
    from transformers.utils import get_json_schema

    by_name: dict[str, str] = {}
    schemas = []
    for path in paths:
        fn = load_callable("env.tools entry", path)
        try:
            schema = get_json_schema(fn)
        except Exception as exc:  # transformers raises its own parsing exceptions
            raise UserError(
                f"env.tools entry {path!r}: its tool schema cannot be built from its signature and docstring ({exc}). "
                "Give every parameter a type hint and a line under 'Args:' in a Google-style docstring."
            ) from None
        name = schema["function"]["name"]
        if name in by_name:
            raise UserError(f"env.tools names two functions {name!r} ({by_name[name]!r} and {path!r}); tool names must differ.")
        by_name[name] = path
        schemas.append(schema)
    return by_name, schemas


def template_renders_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def tool_listing(schemas: list[dict[str, Any]]) -> str:
    """The plain-text preamble that offers the tools where no chat template does."""
    lines = ["Tools you can call:"] + [json.dumps(s["function"]) for s in schemas]
    lines.append(
        'To call one, write <tool_call>{"name": NAME, "arguments": {...}}</tool_call>; '
        f"its result comes back as {RESPONSE_OPEN}RESULT{RESPONSE_CLOSE}. Answer without a tool call when you are done."
    )
    return "\n".join(lines)


class ToolPrompts:
    """Renders prompts with the tools offered (rltrain.data.prompt_data's `PromptRenderer`)."""

    def __init__(self, tokenizer: Any, schemas: list[dict[str, Any]], describe: bool) -> None:
        self.tokenizer, self.schemas, self.describe = tokenizer, schemas, describe

    def text(self, prompt: str) -> str:
        return f"{tool_listing(self.schemas)}\n\n{prompt}" if self.describe else prompt

    def chat(self, messages: list[dict[str, Any]]) -> str:
        if template_renders_tools(self.tokenizer):
            return self.tokenizer.apply_chat_template(messages, tools=self.schemas, tokenize=False, add_generation_prompt=True)
        if self.describe:
            listing = tool_listing(self.schemas)
            if messages and messages[0].get("role") == "system":
                messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{listing}"}, *messages[1:]]
            else:
                messages = [{"role": "system", "content": listing}, *messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] | None  # None: the call could not be read (`problem` says why)
    problem: str = ""


def _read_call(name: Any, arguments: Any) -> ToolCall:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return ToolCall(str(name), None, f"the arguments of {name!r} are not JSON: {arguments!r:.100}")
    if not isinstance(name, str):
        return ToolCall(str(name), None, 'a tool call needs a "name"')
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCall(name, None, f'the "arguments" of {name!r} must be an object, got {arguments!r:.100}')
    return ToolCall(name, arguments)


def parse_tool_calls(text: str, tokenizer: Any = None, schemas: list[dict[str, Any]] | None = None) -> list[ToolCall]:
    """The tool calls in one reply, in order; [] when it calls none (it is the answer)."""
    if tokenizer is not None and getattr(tokenizer, "response_template", None) is not None:
        try:
            message = tokenizer.parse_response(text, prefix="", tools=schemas)
        except Exception:  # a reply the template's parser cannot read: try the Hermes format below
            message = None
        if isinstance(message, dict):
            calls = message.get("tool_calls") or []
            return [_read_call(c.get("function", c).get("name"), c.get("function", c).get("arguments")) for c in calls]
    calls = []
    for body, close in CALL_RE.findall(text):
        if not close:
            calls.append(ToolCall("", None, "the tool call was cut off before </tool_call>"))
            continue
        try:
            parsed = json.loads(body)
        except ValueError:
            calls.append(ToolCall("", None, f"the tool call is not JSON: {body.strip()!r:.100}"))
            continue
        if not isinstance(parsed, dict):
            calls.append(ToolCall("", None, f"the tool call is not a JSON object: {body.strip()!r:.100}"))
            continue
        calls.append(_read_call(parsed.get("name"), parsed.get("arguments", parsed.get("parameters"))))
    return calls


def result_content(result: CallResult, name: str, timeout_s: float | None) -> Content:
    """What the model reads back from one call: the value (text as is, an image or a list of text
    and images as they are, anything else as JSON), or an error."""
    if result.failure == "timeout":
        limit = f" within env.timeout_s={timeout_s:g} s" if timeout_s else ""
        return f"error: {name} did not return{limit}"
    if result.failure is not None:
        return f"error: {result.message}"
    value = from_wire(result.value, f"the tool {name!r}")
    if is_image(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) or is_image(v) for v in value) and any(map(is_image, value)):
        return value
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except TypeError:
        return f"error: {name} returned {type(value).__name__} with images inside; return an image, or a list of text and images"


class CallTools:
    """`EpisodeSteps` for `env=tools`: each reply's tool calls run in call workers; a reply without one ends the episode."""

    def __init__(self, env_cfg: EnvConfig, tokenizer, start_workers: bool = True, observations: ObservationRenderer | None = None) -> None:
        self.cfg, self.tokenizer = env_cfg, tokenizer
        self.observations = observations if observations is not None else ObservationRenderer(tokenizer)
        self.paths, self.schemas = tool_schemas(list(env_cfg.tools))
        self.prompts = ToolPrompts(tokenizer, self.schemas, env_cfg.describe_tools)
        self.native = template_renders_tools(tokenizer)
        self.timeout_s = float(env_cfg.timeout_s) if env_cfg.timeout_s else None
        self.pool = CallPool(env_cfg.workers, [CALL_TOOL, *self.paths.values()], "tool", env_cfg.max_concurrency)
        if start_workers:  # else on the first call
            self.pool.start()

    def reset(self, episodes: list[Episode], deadline: float) -> None:
        """Nothing to reset: the tools were offered in the prompt."""

    def step(self, episodes: list[Episode], deadline: float) -> None:
        parsed = [parse_tool_calls(e.actions[-1], self.tokenizer, self.schemas) for e in episodes]
        calls: list[Call] = []
        for tool_calls in parsed:
            for c in tool_calls:
                if c.arguments is not None and c.name in self.paths:
                    calls.append(Call(CALL_TOOL, {"tool": self.paths[c.name], "arguments": c.arguments}))
        results = iter(self.pool.run(calls, self.timeout_s, deadline) if calls else [])
        for e, tool_calls in zip(episodes, parsed, strict=True):
            if not tool_calls:
                e.done, e.ended_by_env = True, True
                continue
            answers: list[tuple[str, Content]] = []
            for c in tool_calls:
                e.tool_calls += 1
                if c.arguments is None:
                    answers.append((c.name, f"error: {c.problem}"))
                elif c.name not in self.paths:
                    answers.append((c.name, f"error: there is no tool {c.name!r}; the tools are {', '.join(self.paths)}"))
                else:
                    result = next(results)
                    e.timeouts += result.failure == "timeout"
                    e.errors += result.failure is not None and result.failure != "timeout"
                    answers.append((c.name, result_content(result, c.name, self.timeout_s)))
            seen = self.observations.render(self._observation(e, answers), "a tool result", e.chat, e.open_reply())
            e.observe(seen, self.cfg.max_total_tokens - len(e.tokens), self.observations.image_token_id)

    def check(self, episodes: list[Episode]) -> None:
        """A failed tool call is the model's feedback (an error observation), never a reason to stop."""

    def close(self) -> None:
        self.pool.close()

    def _observation(self, e: Episode, answers: list[tuple[str, Content]]) -> Any:
        """The results as the template's tool messages (a chat prompt whose template renders tools),
        else `<tool_response>` blocks: in a user message (a chat prompt) or as text."""
        if e.chat and self.native:
            return [{"role": "tool", "name": name, "content": parts(content)} for name, content in answers]
        segments: list = []
        for _, content in answers:
            segments += [RESPONSE_OPEN, *(content if isinstance(content, list) else [content]), RESPONSE_CLOSE]
        if not any(map(is_image, segments)):
            text = "".join(segments)
            return [{"role": "user", "content": text}] if e.chat else text
        return [{"role": "user", "content": [segment_part(v) for v in segments]}] if e.chat else segments


def parts(content: Content) -> str | list[dict[str, Any]]:
    """A tool message's content: its text, or content parts where it holds images."""
    return [segment_part(v) for v in content] if isinstance(content, list) else content
