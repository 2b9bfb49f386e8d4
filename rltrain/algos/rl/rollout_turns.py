"""The rollout side of an RL step: generating and playing episodes in the engine's turn.

Three things decide where an engine call runs: time sharing (the call happens inside
`TimeSharing.rollout_turn`), a model-parallel replica (only its first rank samples or plays and
shares the result with its peers) and generating ahead (the call queues on the engine's worker
thread behind the batches already submitted). `RolloutTurns` keeps those rules in one place for
the experience collector (rltrain/algos/rl/experience.py). docs/agents.md has env=agent's rules.
"""

from __future__ import annotations

from rltrain.data.prompt_data import PromptRow
from rltrain.envs.agent.runner import AgentRunner
from rltrain.envs.episodes import EpisodeResults, EpisodeRunner
from rltrain.envs.replica import share_results
from rltrain.rollout.ahead import RolloutWorker
from rltrain.rollout.base import Completion, RolloutEngine, SamplingSettings
from rltrain.rollout.share import leads, raise_leader_error, share_completions
from rltrain.runtime.errors import UserError
from rltrain.sync.timeshare import TimeSharing


def refuse_agent_replica(group: object | None) -> None:
    """env=agent serves each rank's agents from its own engine: a replica of several ranks cannot
    take its turns together that way (docs/agents.md)."""
    if group is not None:
        raise UserError(
            "env=agent serves each rank's agents from its own rollout engine; a replica that spans several ranks "
            "(backend.tp or backend.pp > 1) cannot. Use backend.tp=1 backend.pp=1 (FSDP or Megatron data parallel)."
        )


def played_sequences(played: EpisodeResults) -> tuple[list[Completion], list[int] | None]:
    """The sequences the episodes train on and the episode of each (`Experience.episode_of`): an
    agent's episode may make several, as may an episode whose replies the chat template rewrote.
    Always a list, on every rank: whether a rank's episodes made extra sequences differs by rank,
    and the update agrees on its micro-batch counts by a collective where it is set (update.py)."""
    return played.sequences()


class RolloutTurns:
    """Drives the rollout engine for this rank: plain generation and multi-turn episodes."""

    def __init__(
        self, rollout: RolloutEngine, timeshare: TimeSharing, policy, episodes: EpisodeRunner | AgentRunner | None
    ) -> None:
        self.rollout, self.timeshare, self.policy, self.episodes = rollout, timeshare, policy, episodes
        self.worker: RolloutWorker | None = None  # placement.max_staleness >= 1 (rltrain/algos/rl/async_rollouts.py)
        self.worker_wait_s = 0.0

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings, images: list | None = None) -> list[Completion]:
        """Completions for this replica's prompts. Under tensor/pipeline parallelism the replica's
        ranks must train on identical sequences, so only its first rank samples and the others
        receive the tokens (rltrain.rollout.share); every rank of a replica calls this together.
        The engine's turn (time sharing) tears the replica's group down: the leader is found
        before it and the completions are shared after it."""
        leader = leads(self.policy.replica_group())  # found before the turn tears the group down
        with self.timeshare.rollout_turn():
            mine = (self.engine_generate(prompts, sampling, images) if prompts else []) if leader else None
        group = self.policy.replica_group()  # re-created by the turn
        if group is not None:
            return share_completions(mine, group)
        assert mine is not None  # without a replica group every rank leads
        return mine

    def engine_generate(self, prompts: list[list[int]], sampling: SamplingSettings, images: list | None = None) -> list[Completion]:
        """In an asynchronous run the engine is driven by its worker thread: a generation queues
        behind the batches and weights already submitted, so it samples the newest published policy."""
        if self.worker is None:
            return self.rollout.generate(prompts, sampling, images)
        return self.worker.wait(self.worker.submit(self.rollout.generate, prompts, sampling, images), "a generation", self.worker_wait_s)

    def play(self, rows: list[PromptRow], copies: int, sampling: SamplingSettings, phase: str) -> EpisodeResults:
        """`copies` episodes of each of `rows` (rltrain/envs/episodes.py). Under tensor/pipeline
        parallelism only the replica's leader plays them, in one engine turn, and shares the result
        (rltrain/envs/replica.py): environment calls may time out on one rank and not another."""
        assert self.episodes is not None
        group = self.policy.replica_group()
        if isinstance(self.episodes, AgentRunner):
            return self.play_agents(rows, copies, sampling, phase, group)
        if group is None and self.worker is None:
            return self.episodes.run(rows, copies, sampling, phase, self.generate)
        played, error, leader = None, None, group is None or leads(group)
        with self.timeshare.rollout_turn():
            if leader:
                try:
                    played = self._play_episodes(rows, copies, sampling, phase)
                except UserError as exc:
                    if group is None:
                        raise
                    error = str(exc)
        if group is None:
            assert played is not None
            return played
        group = self.policy.replica_group()  # re-created by the turn
        raise_leader_error(error, group)
        return share_results(played, group)

    def _play_episodes(self, rows: list[PromptRow], copies: int, sampling: SamplingSettings, phase: str) -> EpisodeResults:
        """This rank's episodes, played where its engine calls run: in an asynchronous run the whole
        episode loop queues on the engine's worker thread (behind the batches submitted, which play
        their episodes there too), so one thread drives the environment workers."""
        assert self.episodes is not None
        if self.worker is None:
            return self.episodes.run(rows, copies, sampling, phase, self.engine_generate)
        job = self.worker.submit(self.episodes.run, rows, copies, sampling, phase, self.rollout.generate)
        return self.worker.wait(job, f"the {phase} episodes", self.worker_wait_s)

    def play_agents(self, rows: list[PromptRow], copies: int, sampling: SamplingSettings, phase: str, group) -> EpisodeResults:
        """env=agent: the agents' requests come when they come, so the engine serves them for the
        whole phase in one turn; a replica of several ranks (Megatron tp/pp) cannot take its turns
        together that way and is refused (docs/agents.md)."""
        assert isinstance(self.episodes, AgentRunner)
        refuse_agent_replica(group)
        with self.timeshare.rollout_turn():
            return self._play_episodes(rows, copies, sampling, phase)
