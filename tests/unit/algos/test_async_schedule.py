"""The asynchronous schedule (rltrain/algos/rl/async_rollouts.py, rltrain/rollout/ahead.py): which
policy version samples which step's batch, whatever the timing, and a checkpoint's batches in flight.

The engine here is a stand-in that reports the version it holds in every log-probability, so a
batch says which weights sampled it; the real engine runs in tests/e2e/test_cli_async.py.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from rltrain.algos.rl.async_rollouts import AsyncRollouts, sample_version
from rltrain.data.sampler import IndexStream
from rltrain.rollout.ahead import RolloutWorker
from rltrain.rollout.base import Completion, SamplingSettings


class VersionEngine:
    """Generates one completion per prompt whose log-probabilities are the version it holds."""

    def __init__(self, version: int = 0, generate_s: float = 0.0) -> None:
        self.version, self.generate_s = version, generate_s

    def generate(self, prompts, sampling, images=None):
        time.sleep(self.generate_s)
        return [Completion(i, [1], [float(self.version)], True) for i in range(len(prompts))]

    def update_weights(self, weights):
        self.version = int(dict(weights)["v"])


class Collector:
    """What AsyncRollouts reads of the experience collector: prompts, rows, sampling, assembly."""

    def __init__(self, prompts_per_step: int = 3) -> None:
        self.stream = IndexStream(50, seed=0)
        self.prompts_per_step = prompts_per_step
        self.algo_cfg = SimpleNamespace(prompts_per_step=prompts_per_step, dynamic_sampling=False, max_sampling_rounds=1)
        self.policy = SimpleNamespace(replica_group=lambda: None)
        self.episodes = None  # single-turn: no episode runner
        self.turns = SimpleNamespace(worker=None, worker_wait_s=0.0)  # the engine calls AsyncRollouts queues

    def take_prompts(self):
        return self.stream.take(self.prompts_per_step)

    def my_rows(self, index):
        return [SimpleNamespace(ids=[i], images=None) for i in index]

    def sampling(self, step):
        return SamplingSettings(seed=step)

    def assemble(self, step, global_index, completions, generate_s, staleness=0):
        return SimpleNamespace(step=step, prompts=global_index, versions={c.logprobs[0] for c in completions}, staleness=staleness)


def _train(ahead: AsyncRollouts, engine: VersionEngine, steps: range, train_s: float = 0.0) -> list:
    """The trainer's loop: take the batch, 'train', publish version `step`, request ahead."""
    seen = []
    for step in steps:
        exp, _ = ahead.next_experience(step)
        seen.append(exp)
        time.sleep(train_s)
        ahead.worker.submit(engine.update_weights, [("v", torch.tensor(step))])
        ahead.after_update(step)
    return seen


def test_versions_follow_the_schedule():
    assert [sample_version(t, 0) for t in range(1, 5)] == [0, 1, 2, 3]  # synchronous: the trainer's own
    assert [sample_version(t, 1) for t in range(1, 5)] == [0, 0, 1, 2]
    assert [sample_version(t, 2) for t in range(1, 6)] == [0, 0, 0, 1, 2]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize(("generate_s", "train_s"), [(0.0, 0.02), (0.02, 0.0)])
def test_each_batch_is_sampled_by_exactly_its_version_whichever_side_is_slower(k, generate_s, train_s):
    engine = VersionEngine(generate_s=generate_s)
    ahead = AsyncRollouts(Collector(), engine, RolloutWorker(), k, max_steps=7, wait_timeout_s=30, rank=0)
    try:
        seen = _train(ahead, engine, range(1, 8), train_s)
    finally:
        ahead.close()
    for exp in seen:
        assert exp.versions == {float(sample_version(exp.step, k))}, exp
        assert exp.staleness == min(exp.step - 1, k)
    # The same prompts, step for step, as the synchronous stream draws them.
    stream = IndexStream(50, seed=0)
    assert [exp.prompts for exp in seen] == [stream.take(3) for _ in range(7)]
    assert not ahead.pending  # nothing requested past the last step


@pytest.mark.parametrize("k", [1, 2])
def test_a_checkpoint_between_steps_resumes_the_same_batches(k, tmp_path):
    engine = VersionEngine(generate_s=0.01)
    full = AsyncRollouts(Collector(), engine, RolloutWorker(), k, max_steps=8, wait_timeout_s=30, rank=0)
    try:
        uninterrupted = _train(full, engine, range(1, 9))
    finally:
        full.close()

    engine = VersionEngine(generate_s=0.01)
    first = AsyncRollouts(Collector(), engine, RolloutWorker(), k, max_steps=8, wait_timeout_s=30, rank=0)
    try:
        before = _train(first, engine, range(1, 4))
        first.save_checkpoint(tmp_path)
        stream_state = first.collector.stream.state_dict()
    finally:
        first.close()
    # A new process: the weights of version 3 from the checkpoint, the stream where it was.
    engine = VersionEngine(version=3, generate_s=0.01)
    collector = Collector()
    collector.stream.load_state_dict(stream_state)
    resumed = AsyncRollouts(collector, engine, RolloutWorker(), k, max_steps=8, wait_timeout_s=30, rank=0)
    resumed.load_checkpoint(tmp_path)
    try:
        after = _train(resumed, engine, range(4, 9))
    finally:
        resumed.close()
    assert [(e.step, e.prompts, e.versions) for e in before + after] == [(e.step, e.prompts, e.versions) for e in uninterrupted]


def test_a_failed_engine_call_fails_the_batches_behind_it_and_a_slow_one_is_bounded():
    worker = RolloutWorker()
    try:
        def boom():
            raise RuntimeError("the child died")

        first, second = worker.submit(boom), worker.submit(lambda: 1)
        with pytest.raises(RuntimeError, match="the child died"):
            worker.wait(first, "a batch", 5)
        with pytest.raises(RuntimeError, match="an earlier rollout call failed"):
            worker.wait(second, "a batch", 5)
    finally:
        worker.close()
    worker = RolloutWorker()
    release = threading.Event()
    try:
        slow = worker.submit(release.wait, 30)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="did not deliver step 4's batch within 0.2 s"):
            worker.wait(slow, "step 4's batch", 0.2)
        assert time.monotonic() - started < 5
    finally:
        release.set()
        worker.close()


def test_the_engine_idle_time_is_what_it_waited_for_work():
    worker = RolloutWorker()
    try:
        worker.pop_idle_s()
        started = time.perf_counter()
        time.sleep(0.2)
        worker.wait(worker.submit(time.sleep, 0.2), "a batch", 5)
        idle = worker.pop_idle_s()
        elapsed = time.perf_counter() - started
        # It waited through the first sleep, and its own 0.2 s of work is not idle time.
        assert 0.2 <= idle <= elapsed - 0.2 + 1e-3, (idle, elapsed)
    finally:
        worker.close()


class AgentEpisodes:
    """An agent runner stand-in: per row, an episode of two calls that rewrote its history (two
    sequences), each call an engine call of its own, as the endpoint makes them."""

    def run(self, rows, copies, sampling, phase, generate):
        from rltrain.envs.agent.runner import AgentResults
        from rltrain.rewards.scoring import Failures

        last, first = [], []
        for i, row in enumerate(rows):
            first += [replace(c, prompt_index=i, prompt_ids=list(row.ids)) for c in generate([row.ids], sampling)]
            last += [replace(c, prompt_index=i, prompt_ids=[*row.ids, 0]) for c in generate([[*row.ids, 0]], sampling)]
        return AgentResults(
            last, [1.0] * len(rows), [""] * len(rows), Failures(), 2.0 * len(rows), 0.0,
            named={"correct": [1.0] * len(rows)}, counts={"history_rewrites": float(len(rows))}, extra=first,
            extra_episode=list(range(len(rows))),
        )


class AgentCollector(Collector):
    def __init__(self) -> None:
        super().__init__()
        self.episodes = AgentEpisodes()
        self.algo_cfg.group_size = 1

    def assemble_played(self, step, global_index, played, generate_s, staleness=0):
        sequences, episode_of = played.sequences()
        return SimpleNamespace(
            step=step, prompts=global_index, versions={c.logprobs[0] for c in sequences}, staleness=staleness,
            sequences=[(c.prompt_index, c.prompt_ids, c.token_ids) for c in sequences], episode_of=episode_of, named=played.named,
        )


def test_agent_batches_are_played_by_their_version_and_resume_whole_from_a_checkpoint(tmp_path):
    """env=agent ahead (docs/async.md): every call of a batch's episodes by its one version; a
    checkpoint keeps each played batch's every sequence and the episode of each."""
    k = 1
    engine = VersionEngine(generate_s=0.01)
    full = AsyncRollouts(AgentCollector(), engine, RolloutWorker(), k, max_steps=5, wait_timeout_s=30, rank=0)
    try:
        uninterrupted = _train(full, engine, range(1, 6))
    finally:
        full.close()
    for exp in uninterrupted:
        assert exp.versions == {float(sample_version(exp.step, k))} and exp.episode_of == [0, 1, 2, 0, 1, 2], exp
    engine = VersionEngine(generate_s=0.01)
    first = AsyncRollouts(AgentCollector(), engine, RolloutWorker(), k, max_steps=5, wait_timeout_s=30, rank=0)
    try:
        before = _train(first, engine, range(1, 3))
        first.save_checkpoint(tmp_path)
        stream_state = first.collector.stream.state_dict()
    finally:
        first.close()
    engine = VersionEngine(version=2, generate_s=0.01)
    collector = AgentCollector()
    collector.stream.load_state_dict(stream_state)
    resumed = AsyncRollouts(collector, engine, RolloutWorker(), k, max_steps=5, wait_timeout_s=30, rank=0)
    resumed.load_checkpoint(tmp_path)
    try:
        after = _train(resumed, engine, range(3, 6))
    finally:
        resumed.close()
    assert [vars(e) for e in before + after] == [vars(e) for e in uninterrupted]
