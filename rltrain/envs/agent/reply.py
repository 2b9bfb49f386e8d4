"""Between OpenAI's chat format and the model's tokens (env=agent): the messages a chat template
renders (a vision-language model's `image_url` parts as image parts), a reply cut at the request's
`stop` strings, and the reply as an OpenAI choice with `tool_calls` read by env=tools' parser
(rltrain/envs/tools.py). docs/agents.md, "The endpoint".
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from rltrain.envs.agent.endpoint import SERVED_MODEL, ApiError
from rltrain.envs.tools import CALL_RE, parse_tool_calls


def template_content(content: list[Any], sees: bool) -> str | list[dict[str, Any]]:
    """A message's content parts as chat templates read them: text parts joined; where the model
    `sees` and the message has `image_url` parts, a list of text parts and `{"type": "image"}`."""
    kinds = [p.get("type") if isinstance(p, dict) else None for p in content]
    if any(kind not in ("text", "image_url") for kind in kinds):
        raise ApiError(400, "only text and image_url content parts are supported (no audio or files)")
    if "image_url" not in kinds:
        return "".join(str(p.get("text", "")) for p in content)
    if not sees:
        raise ApiError(
            400, "this run's model is text-only: it cannot read image_url content parts. Train a vision-language model "
            "(model=tiny_vl, or a model.path that AutoModelForImageTextToText loads), or send text."
        )
    return [{"type": "text", "text": str(p.get("text", ""))} if p["type"] == "text" else {"type": "image"} for p in content]


def template_messages(messages: list[dict[str, Any]], sees: bool = False) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates read them: content as text ("" for none, text parts
    joined; image parts kept where the model `sees`), and tool-call arguments as objects
    (templates write them with `tojson`)."""
    out = []
    for m in messages:
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            content = template_content(content, sees)
        m["content"] = "" if content is None else content
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                function = dict(c.get("function") or {})
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        function["arguments"] = json.loads(arguments) if arguments.strip() else {}
                    except ValueError:
                        raise ApiError(400, f"the arguments of tool call {c.get('id')!r} are not JSON: {arguments!r:.100}") from None
                calls.append({**c, "function": function})
            m["tool_calls"] = calls
        out.append(m)
    return out


def render(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, chat_template: str | None, sees: bool = False,
) -> str:
    """The text the model reads for a request: its chat template (or `env.chat_template`) with the
    tools, ending in the generation prompt."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "the model's tokenizer has no chat template to render messages with (set env.chat_template)")
    try:
        return tokenizer.apply_chat_template(
            template_messages(messages, sees), tools=tools, tokenize=False, add_generation_prompt=True, chat_template=chat_template
        )
    except ApiError:
        raise
    except Exception as exc:  # the template's own errors (jinja, raise_exception): the request is at fault
        raise ApiError(400, f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") from None


@dataclass
class Reply:
    """One sampled reply as served: its ids (cut at a stop string), their log-probabilities, its text."""

    ids: list[int]
    logprobs: list[float]
    finished: bool  # stopped (a stop token or string), not cut at max_tokens
    text: str


def cut_reply(tokenizer: Any, ids: list[int], logprobs: list[float], finished: bool, stop_ids: list[int], stops: list[str]) -> Reply:
    """The reply up to its first stop string (the tokens through the one that completes it: a prefix
    of what was sampled, so still a sample), its text without the stop token or string."""

    def text_of(part: list[int]) -> str:
        return tokenizer.decode([t for t in part if t not in stop_ids], skip_special_tokens=True)

    text = text_of(ids)
    hits = [text.find(s) for s in stops if s in text]
    if not hits:
        return Reply(list(ids), list(logprobs), finished, text)
    at = min(hits)
    for k in range(1, len(ids) + 1):
        if any(s in text_of(ids[:k]) for s in stops):
            return Reply(list(ids[:k]), list(logprobs[:k]), True, text[:at])
    return Reply(list(ids), list(logprobs), True, text[:at])


def choice(tokenizer: Any, reply: Reply, index: int, tools: list[dict[str, Any]] | None, call_id: str) -> dict[str, Any]:
    """One OpenAI choice: the text, or the tool calls it makes (Hermes `<tool_call>` or the
    template's own format) with the text around them as content."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    calls = [c for c in parse_tool_calls(reply.text, tokenizer, tools) if c.arguments is not None] if tools else []
    if calls:
        message["content"] = CALL_RE.sub("", reply.text).strip() or None
        message["tool_calls"] = [
            {"id": f"{call_id}_{j}", "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for j, c in enumerate(calls)
        ]
    reason = "tool_calls" if calls else ("stop" if reply.finished else "length")
    return {"index": index, "message": message, "finish_reason": reason, "logprobs": None}


def completion_body(call_id: str, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "id": call_id, "object": "chat.completion", "created": int(time.time()), "model": SERVED_MODEL, "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens},
    }
