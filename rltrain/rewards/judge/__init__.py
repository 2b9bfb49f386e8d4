"""The LLM judge (`reward_model=judge`): `prompts` (the Jinja template over a row), `verdicts` (a
score from a verdict), `endpoint` (OpenAI-compatible HTTP), `judge` (the reward function, concurrent
and bounded), `served` (a judge model in a vLLM server of the run), `build` (settings, key), and
`tiny_judge` (the recipe's judge). docs/rewards-and-roles.md, "The LLM judge".
"""
