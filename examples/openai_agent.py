"""An agent written with the plain `openai` client, trained unchanged with `env=agent`.

    PYTHONPATH=examples python -m rltrain algo=grpo env=agent env.agent=openai_agent:run

`run(client, row)` gets an OpenAI client pointed at the run's endpoint (any `model` name: the run
serves its policy) and one row of the data (the built-in addition task: `prompt` "12+34=" and
`answer`). It offers the model an `add` tool, runs the tool calls the model makes, gives a wrong
answer one more try, and returns its reward: here a dict of named rewards, summed, each logged as
`reward/<name>` (docs/agents.md).
"""

from __future__ import annotations

import json

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def add(a: int, b: int) -> int:
    return a + b


def run(client, row: dict) -> dict[str, float]:
    messages: list[dict] = [{"role": "user", "content": row["prompt"]}]
    answer = ""
    for _ in range(4):
        reply = client.chat.completions.create(model="any", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # the reply as served: the conversation only grows
        if message.tool_calls:
            for call in message.tool_calls:
                try:
                    result = str(add(**json.loads(call.function.arguments)))
                except (TypeError, ValueError) as exc:
                    result = f"error: {exc}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            continue
        answer = (message.content or "").strip()
        if answer == row["answer"] or len(messages) > 2:
            break
        messages.append({"role": "user", "content": "Not quite. Once more, just the number:"})  # one more try
    return {"correct": float(answer == row["answer"]), "brief": 0.1 * float(0 < len(answer) <= 4)}
