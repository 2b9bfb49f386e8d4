"""Rewards, `fn(prompts, completions, **columns) -> list[float]`: which functions a run scores with
and how they are called (`scoring`: chunks in killable worker processes, failures counted), the
built-in task's reward (`builtin`), a math answer checker (`math`), code run against tests (`code`,
in the `sandbox` package; answers after a `thinking` block), a reward model (`model_reward`) and
DAPO's overlong penalty (`overlong`). docs/rewards-and-roles.md explains the signature, the
weighting and the bounds.
"""
