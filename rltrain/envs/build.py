"""The episode runner a run's `env` group asks for: a user environment class, a set of tools, a TextArena game,
an agent, or an OpenEnv environment."""

from __future__ import annotations

from typing import Any

from rltrain.config.schema import Config
from rltrain.data.prompt_data import PromptRenderer
from rltrain.envs.agent.runner import AgentRunner
from rltrain.envs.episodes import EpisodeRunner, EpisodeSteps
from rltrain.envs.observations import ObservationRenderer
from rltrain.envs.tools import CallTools
from rltrain.envs.user_env import HostedEnvironments


def build_episode_runner(cfg: Config, tokenizer, start_workers: bool = True, processor: Any = None) -> EpisodeRunner | AgentRunner | None:
    """None for `env=none` (single-turn RL). `start_workers=False`: the user-code workers start on
    their first call (a rank that never plays: a tensor/pipeline-parallel replica's peers).
    `processor`: a vision-language model's (None: text-only), which puts images into episodes."""
    if cfg.env.name == "none":
        return None
    observations = ObservationRenderer(tokenizer, processor)
    if cfg.env.name == "agent":
        return AgentRunner(
            cfg.env, cfg.reward, tokenizer, cfg.algo.max_new_tokens, cfg.data.max_length, cfg.safety.collective_timeout_s, start_workers,
            observations,
        )
    steps: EpisodeSteps
    renderer: PromptRenderer | None
    if cfg.env.name == "tools":
        steps = CallTools(cfg.env, tokenizer, start_workers, observations)
        renderer = steps.prompts
    elif cfg.env.name == "openenv":
        from rltrain.envs.openenv.check import hosting

        steps, renderer = HostedEnvironments(cfg.env, cfg.reward, tokenizer, start_workers, observations, hosting(cfg.env)), None
    elif cfg.env.name == "textarena":
        from rltrain.envs.textarena.game_check import players_of
        from rltrain.envs.textarena.steps import TextArenaGames

        games = TextArenaGames(cfg.env, cfg.reward, tokenizer, players_of(cfg.env.game), start_workers, observations)
        steps, renderer = games, games.prompts
    else:
        steps, renderer = HostedEnvironments(cfg.env, cfg.reward, tokenizer, start_workers, observations), None
    return EpisodeRunner(
        cfg.env, cfg.reward, tokenizer, cfg.algo.max_new_tokens, cfg.safety.collective_timeout_s, steps, renderer,
        observations.image_token_id,
    )
