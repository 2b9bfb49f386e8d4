"""Rewards, `fn(prompts, completions, **columns) -> list[float]`: which functions a run scores with
and how (`scoring`: chunks in killable workers), the built-in task's reward (`builtin`), math answers
(`math`), code against tests in the `sandbox` package (`code`; answers after a `thinking` block), a
reward model (`model_reward`; one that sees images, `vision_model_reward`), DAPO's overlong penalty
(`overlong`). docs/rewards-and-roles.md explains the signature, the weighting and the bounds.
"""
