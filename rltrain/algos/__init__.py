"""The algorithms: SFT (`sft`), DPO (`dpo`) and the RL step GRPO and PPO share (`rl`: collect with
`experience`, the engine's turns in `rollout_turns`, ahead in `async_rollouts` / `inflight_rollouts`,
learn with `rl_update`, publish through rltrain.sync; evaluate with `rl_evaluation`), every loss in `losses` and
every advantage in `advantages` as pure functions. Algorithms never import a backend: they build
engines through the lazy registries. docs/algorithms.md says what each one computes.
"""
