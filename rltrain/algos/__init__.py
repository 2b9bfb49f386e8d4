"""The algorithms: SFT (`sft`), DPO (`dpo`) and the RL step GRPO and PPO share (`rl`: collect with
`experience`, learn with `rl_update`, publish through rltrain.sync), with every loss in `losses` and
every advantage in `advantages` as pure functions. Algorithms never import a backend: they build
engines through the lazy registries. docs/algorithms.md says what each one computes.
"""
