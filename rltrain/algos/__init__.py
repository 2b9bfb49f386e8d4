"""The algorithms, one module each (its config, check, loss, implementation and `SPEC`; `registry`
lists them): SFT, DPO, SimPO, ORPO, KTO and the reward model (on `preference`), GRPO, PPO and
distillation (on the RL pipeline in `rl/`); the shared pure functions: `policy_loss` (the surrogate
table), `advantages`, `rollout_correction`. Algorithms never import a backend. docs/algorithms.md.
"""
