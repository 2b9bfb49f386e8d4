"""The episode runner a run's `env` group asks for: a user environment class or a set of tools."""

from __future__ import annotations

from rltrain.envs.episodes import EpisodeRunner, EpisodeSteps
from rltrain.envs.tools import CallTools
from rltrain.envs.user_env import HostedEnvironments


def build_episode_runner(cfg, tokenizer) -> EpisodeRunner | None:
    """None for `env=none` (single-turn RL)."""
    if cfg.env.name == "none":
        return None
    steps: EpisodeSteps
    if cfg.env.name == "tools":
        steps = CallTools(cfg.env, tokenizer)
        renderer = steps.prompts
    else:
        steps, renderer = HostedEnvironments(cfg.env, cfg.reward, tokenizer), None
    return EpisodeRunner(cfg.env, cfg.reward, tokenizer, cfg.algo.max_new_tokens, cfg.safety.collective_timeout_s, steps, renderer)
