"""Generating ahead of the trainer (`placement.max_staleness` = k >= 1) on a fixed schedule.

A policy version counts the RL updates its weights hold: the trainer starts step t (1-based) at
version t - 1, and step t's batch is sampled by version `sample_version(t, k)` = max(0, t - 1 - k)
exactly, because the engine's worker runs generations and weight loads in submission order
(rltrain/rollout/ahead.py). After step t's update the trainer publishes version t and requests step
t + 1 + k. A checkpoint keeps the in-flight batches sampled by older versions (per rank) and the
prompts of the one its own weights regenerate, so a resumed run trains exactly the same batches.
A multi-turn batch (env=python|tools|agent) is played whole by the worker before the next weight
load: one version samples it all. docs/async.md has the schedule, the loss, the episodes and the measurements.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rltrain.algos.rl.experience import Experience, ExperienceCollector
from rltrain.algos.rl.rollout_turns import refuse_agent_replica
from rltrain.envs.agent.runner import AgentRunner, played_from_json, played_to_json
from rltrain.envs.episodes import EpisodeResults
from rltrain.envs.replica import share_results
from rltrain.rollout.ahead import RolloutWorker
from rltrain.rollout.base import Completion, RolloutEngine, SamplingSettings
from rltrain.rollout.control_wire import completions_from_json, completions_to_json
from rltrain.rollout.share import leads, raise_leader_error, share_completions
from rltrain.runtime.errors import UserError

# This rank's completions (or, multi-turn, its played episodes) and the seconds the worker spent on them.
Generated = tuple[list[Completion] | EpisodeResults, float]


def sample_version(step: int, max_staleness: int) -> int:
    """The policy version that samples step `step`'s batch (steps count from 1)."""
    return max(0, step - 1 - max_staleness)


@dataclass
class Ticket:
    """A batch requested from the engine: its step, prompts (global indices) and sampling version.
    `future` is None on a model-parallel replica's other ranks (the leader generates and shares)."""

    step: int
    global_index: list[int]
    version: int
    future: Future[Generated] | None


class AsyncRollouts:
    """The schedule of batches in flight; also a checkpoint part (`save_checkpoint`/`load_checkpoint`)."""

    def __init__(
        self, collector: ExperienceCollector, rollout: RolloutEngine, worker: RolloutWorker, max_staleness: int,
        max_steps: int, wait_timeout_s: float, rank: int,
    ) -> None:
        self.collector, self.rollout, self.worker = collector, rollout, worker
        collector.turns.worker, collector.turns.worker_wait_s = worker, wait_timeout_s  # evaluation queues behind the batches
        self.k, self.max_steps, self.wait_timeout_s, self.rank = max_staleness, max_steps, wait_timeout_s, rank
        self.pending: dict[int, Ticket] = {}
        self.restored: dict[int, tuple[list[int], Generated | None]] = {}
        self.started = False
        self.version = 0  # the newest version published (and requested from)

    def _leads(self) -> bool:
        return leads(self.collector.policy.replica_group())

    def _generate(self, prompts: list[list[int]], sampling: SamplingSettings, images: list | None = None) -> Generated:
        started = time.perf_counter()
        completions = self.rollout.generate(prompts, sampling, images) if prompts else []
        return completions, time.perf_counter() - started

    def request(self, step: int, global_index: list[int] | None = None, done: Generated | None = None) -> None:
        """Queue step `step`'s batch behind everything submitted so far (nothing past the last step)."""
        if step > self.max_steps or step in self.pending:
            return
        index = global_index if global_index is not None else self._take_prompts()
        future: Future[Generated] | None = None
        if done is not None:
            future = Future()
            future.set_result(done)
        elif self._leads() and self.collector.episodes is not None:
            future = self.worker.submit(self._play, self.collector.my_rows(index), step)
        elif self._leads():
            rows = [r for block in self._rounds(index) for r in self.collector.my_rows(block)]
            future = self.worker.submit(self._generate, [r.ids for r in rows], self.collector.sampling(step), [r.images or [] for r in rows])
        self.pending[step] = Ticket(step, index, sample_version(step, self.k), future)

    def _play(self, rows: list, step: int) -> Generated:
        """Step `step`'s episodes, every turn, on the worker's thread (the engine called directly):
        exactly what the synchronous step plays (rltrain/envs/episodes.py; env=agent: the endpoint
        served from this thread, rltrain/envs/agent/runner.py), by one version."""
        assert self.collector.episodes is not None
        started = time.perf_counter()
        played = self.collector.episodes.run(
            rows, self.collector.algo_cfg.group_size, self.collector.sampling(step), f"train-{step}", self.rollout.generate
        )
        return played, time.perf_counter() - started

    def _take_prompts(self) -> list[int]:
        """A batch's prompts. With dynamic sampling every round the step may need is taken and
        generated at once, so all of them are sampled by the batch's one version; the step uses as
        many rounds as it needs (`ExperienceCollector.collect_signal`)."""
        rounds = self.collector.algo_cfg.max_sampling_rounds if self.collector.algo_cfg.dynamic_sampling else 1
        return [i for _ in range(rounds) for i in self.collector.take_prompts()]

    def _rounds(self, index: list[int]) -> list[list[int]]:
        """`index` (one or more rounds of `algo.prompts_per_step` prompts) split into its rounds."""
        per_round = self.collector.algo_cfg.prompts_per_step
        return [index[i : i + per_round] for i in range(0, len(index), per_round)]

    def _start(self, step: int) -> None:
        """Fill the pipeline at the first step of this process: steps `step` .. `step + k`, from a
        checkpoint's batches where it holds them, else generated now (by this version)."""
        self.started = True
        if isinstance(self.collector.episodes, AgentRunner):
            refuse_agent_replica(self.collector.policy.replica_group())
        self.worker.pop_idle_s()  # `time/wait_train` counts from the first step
        for s in range(step, step + self.k + 1):
            index, done = self.restored.pop(s, (None, None))
            self.request(s, index, done)
        self.restored.clear()

    def next_experience(self, step: int) -> tuple[Experience, float]:
        """Step `step`'s experience and the seconds the trainer waited for its batch."""
        if not self.started:
            self._start(step)
        ticket = self.pending.pop(step)
        waited = time.perf_counter()
        mine: list[Completion] | EpisodeResults | None = None
        generate_s, error = 0.0, None
        if ticket.future is not None:
            try:
                mine, generate_s = self.worker.wait(ticket.future, f"step {step}'s batch", self.wait_timeout_s)
            except UserError as exc:  # too many failed episodes: every rank of the replica stops with it
                error = str(exc)
        wait_s = time.perf_counter() - waited
        group = self.collector.policy.replica_group()
        staleness = (step - 1) - ticket.version
        if self.collector.episodes is not None:
            if group is not None:
                raise_leader_error(error, group)
            elif error is not None:
                raise UserError(error)
            played = share_results(mine if isinstance(mine, EpisodeResults) else None, group) if group is not None else mine
            assert isinstance(played, EpisodeResults)
            return self.collector.assemble_played(step, ticket.global_index, played, generate_s, staleness), wait_s
        assert not isinstance(mine, EpisodeResults)
        completions = share_completions(mine, group) if group is not None else mine
        assert completions is not None  # without a replica group every rank generates
        if not self.collector.algo_cfg.dynamic_sampling:
            return self.collector.assemble(step, ticket.global_index, completions, generate_s, staleness=staleness), wait_s
        by_round: list[tuple[list[int], list[Completion]]] = []
        first_row = 0  # the rounds were generated in one call: each round's prompt indices start at 0
        for block in self._rounds(ticket.global_index):
            count = len(self.collector.my_rows(block))
            mine = [replace(c, prompt_index=c.prompt_index - first_row) for c in completions if first_row <= c.prompt_index < first_row + count]
            by_round.append((block, mine))
            first_row += count
        first_index, first = by_round[0]
        exp = self.collector.collect_signal(
            step, first_index, self.collector.my_rows(first_index), first, generate_s, staleness, more=lambda r: by_round[r]
        )
        exp.global_index = ticket.global_index  # every round was taken from the stream, used or not
        return exp, wait_s

    def after_update(self, step: int) -> None:
        """Version `step` is published: request the batch it samples."""
        self.version = step
        self.request(step + 1 + self.k)

    # --- checkpoint part (rltrain/run/checkpoint.py calls these on every rank) -----------------

    def save_checkpoint(self, directory: Path) -> None:
        """The batches in flight after step t: those sampled by versions before t are waited for
        and written; the one version t samples keeps only its prompts (the checkpoint's weights
        regenerate it)."""
        rows: list[dict[str, Any]] = []
        for step in sorted(self.pending):
            ticket = self.pending[step]
            completions, generate_s = None, 0.0
            if ticket.future is not None and ticket.version < self.version:
                done, generate_s = self.worker.wait(ticket.future, f"step {step}'s batch", self.wait_timeout_s)
                completions = played_to_json(done) if isinstance(done, EpisodeResults) else completions_to_json(done)
            rows.append({
                "step": step, "global_index": ticket.global_index, "version": ticket.version, "completions": completions,
                "generate_s": generate_s,
            })
        (directory / f"rank{self.rank}.json").write_text(json.dumps({"max_staleness": self.k, "pending": rows}))

    def load_checkpoint(self, directory: Path) -> None:
        state = json.loads((directory / f"rank{self.rank}.json").read_text())
        for row in state["pending"]:
            done: Generated | None = None
            if isinstance(row["completions"], dict):  # played episodes
                done = (played_from_json(row["completions"]), float(row["generate_s"]))
            elif row["completions"] is not None:
                done = (completions_from_json(row["completions"]), float(row["generate_s"]))
            self.restored[int(row["step"])] = ([int(i) for i in row["global_index"]], done)

    def close(self) -> None:
        self.worker.close()
