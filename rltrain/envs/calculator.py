"""The built-in tool task's tool (`data.task=multiplication`, `+experiment=grpo_calculator`): the product
the tiny model cannot compute, one call away (docs/environments.md, "The built-in tool task"); and the
same task as an OpenAI-client agent (`+experiment=agent_calculator`, docs/agents.md)."""

from __future__ import annotations

import json
from typing import Any


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


MULTIPLY_TOOL = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
    },
}


def solve(client: Any, row: dict[str, Any]) -> float:
    """The built-in tool task as an agent (`+experiment=agent_calculator`, env=agent): the OpenAI
    client's tool-calling loop with `multiply`; 1.0 for the exact product, else 0.0."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    answer = ""
    for _ in range(4):
        message = client.chat.completions.create(model="policy", messages=messages, tools=[MULTIPLY_TOOL]).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = message.content or ""
            break
        for call in message.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = str(multiply(int(args["a"]), int(args["b"])))
            except (KeyError, TypeError, ValueError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return float(answer.strip() == str(row["answer"]).strip())
