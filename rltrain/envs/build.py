"""The episode runner a run's `env` group asks for: a user environment class or a set of tools."""

from __future__ import annotations

from rltrain.config.schema import Config
from rltrain.envs.episodes import EpisodeRunner, EpisodeSteps
from rltrain.envs.tools import CallTools
from rltrain.envs.user_env import HostedEnvironments


def build_episode_runner(cfg: Config, tokenizer, start_workers: bool = True) -> EpisodeRunner | None:
    """None for `env=none` (single-turn RL). `start_workers=False`: the user-code workers start on
    their first call (a rank that never plays: a tensor/pipeline-parallel replica's peers)."""
    if cfg.env.name == "none":
        return None
    steps: EpisodeSteps
    if cfg.env.name == "tools":
        steps = CallTools(cfg.env, tokenizer, start_workers)
        renderer = steps.prompts
    else:
        steps, renderer = HostedEnvironments(cfg.env, cfg.reward, tokenizer, start_workers), None
    return EpisodeRunner(cfg.env, cfg.reward, tokenizer, cfg.algo.max_new_tokens, cfg.safety.collective_timeout_s, steps, renderer)
