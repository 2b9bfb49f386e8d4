"""An agent written with the OpenAI Agents SDK (`openai-agents`), trained unchanged with `env=agent`.

    PYTHONPATH=examples python -m rltrain algo=grpo env=agent env.agent=agents_sdk_agent:run

The SDK builds its own client: it finds the run's endpoint in OPENAI_BASE_URL / OPENAI_API_KEY,
which rltrain sets in the agent's worker. The endpoint serves the Chat Completions API, so the SDK
is told to use it (`set_default_openai_api("chat_completions")`); tracing is off (nothing leaves the
machine). The task is the built-in addition task: `prompt` "12+34=" and `answer` (docs/agents.md).
"""

from __future__ import annotations

from agents import Agent, Runner, function_tool, set_default_openai_api, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError

set_default_openai_api("chat_completions")
set_tracing_disabled(True)


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


ADDER = Agent(name="adder", instructions="Answer with the number only. You may call add.", tools=[add], model="policy")


async def run(client, row: dict) -> float:
    """`client` is unused: the SDK makes its own from the environment, as it would anywhere."""
    try:
        result = await Runner.run(ADDER, row["prompt"], max_turns=3)
    except (MaxTurnsExceeded, ModelBehaviorError):  # the model kept calling tools, or called one that is not there
        return 0.0
    return float(str(result.final_output).strip() == row["answer"])
