"""The RL pipeline GRPO, PPO and distillation share: the step (`algorithm`), its parts (`builder`),
their keys (`config`), collecting experience (`experience`, `rollout_turns`, `dynamic_sampling`),
generating ahead and in flight (`async_rollouts`, `inflight_rollouts`), the update (`update`) and
held-out evaluation (`evaluation`). docs/internals/algos.md.
"""
