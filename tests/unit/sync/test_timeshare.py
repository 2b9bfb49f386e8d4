"""The phase machine of time sharing (rltrain/sync/timeshare.py), with recording fakes.

Checks the order of every call in a turn, that shared communicators are torn down once, that the
weights are exported before the teardown into a host copy that no later training step can
change, that each phase reports time and memory, and that with time sharing off nothing but
`generate` and `train` run and the sync happens at once.
"""

from __future__ import annotations

import torch

from rltrain.sync.timeshare import PHASES, TimeSharing, resident_mib
from rltrain.sync.weight_sync import WeightSync


class Groups:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def teardown(self) -> None:
        self.log.append(f"teardown {self.name}")

    def recreate(self) -> int:
        self.log.append(f"recreate {self.name}")
        return 1


class Engine:
    def __init__(self, log: list[str], name: str, groups: Groups | None) -> None:
        self.log, self.name, self.groups = log, name, groups
        self.weight = torch.ones(3)

    def offload(self) -> None:
        self.log.append(f"offload {self.name}")

    def onload(self) -> None:
        self.log.append(f"onload {self.name}")

    def export_weights(self):
        self.log.append(f"export {self.name}")
        yield "w", self.weight  # a view of the live parameter, as an unsharded export is


class Rollout:
    weights_survive_sleep = True

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.received: list[dict[str, torch.Tensor]] = []

    def sleep(self) -> None:
        self.log.append("sleep")

    def wake(self) -> None:
        self.log.append("wake")

    def update_weights(self, weights) -> None:
        self.log.append("sync")
        self.received.append({k: v.clone() for k, v in weights})


def _setup(enabled: bool):
    log: list[str] = []
    shared = Groups(log, "mp")
    policy, reference = Engine(log, "policy", shared), Engine(log, "reference", shared)
    rollout = Rollout(log)
    ts = TimeSharing([policy, reference], rollout, torch.device("cpu"), enabled, WeightSync(rollout, deferred=enabled))
    return log, policy, rollout, ts


def _step(ts: TimeSharing, policy: Engine, log: list[str]) -> dict[str, float]:
    with ts.rollout_turn():
        log.append("generate")
    with ts.train():
        log.append("train")
        policy.weight.add_(1.0)
    ts.weights.publish(policy.export_weights)
    return ts.pop_metrics()


def test_phase_order_and_export_before_teardown():
    log, policy, rollout, ts = _setup(enabled=True)
    assert log == ["sleep"]  # between turns the trainer holds the accelerator
    log.clear()
    first = _step(ts, policy, log)
    assert log == [
        "offload policy", "offload reference", "teardown mp", "wake", "generate", "sleep",
        "recreate mp", "onload policy", "onload reference", "train", "export policy",
    ]  # fmt: skip
    assert rollout.received == []  # nothing new to sync before the first train phase
    policy.weight.add_(100.0)  # the next optimizer step must not leak into the exported copy
    log.clear()
    _step(ts, policy, log)
    assert log[:5] == ["offload policy", "offload reference", "teardown mp", "wake", "sync"]
    assert torch.equal(rollout.received[0]["w"], torch.full((3,), 2.0))
    for phase in PHASES:
        assert first[f"time/phase/{phase}"] >= 0.0 and first[f"mem/{phase}"] > 0.0


def test_without_time_sharing_only_generate_and_train_are_phases():
    log, policy, rollout, ts = _setup(enabled=False)
    metrics = _step(ts, policy, log)
    assert log == ["generate", "train", "sync", "export policy"]  # the export streams into the engine
    assert sorted(k for k in metrics if k.startswith("time/phase/")) == [
        "time/phase/generate",
        "time/phase/train",
    ]
    assert ts.weights.last_sync_s > 0.0 and ts.weights.last_publish_s >= ts.weights.last_sync_s


def test_resident_memory_is_reported():
    assert 1.0 < resident_mib() < 1 << 20


class ForgetfulRollout(Rollout):
    """An engine whose sleep discards its weights (vLLM at rollout.sleep_level=2 on CUDA)."""

    weights_survive_sleep = False


def test_an_engine_that_drops_its_weights_gets_them_again_after_every_wake():
    log: list[str] = []
    policy = Engine(log, "policy", None)
    rollout = ForgetfulRollout(log)
    ts = TimeSharing([policy], rollout, torch.device("cpu"), True, WeightSync(rollout, deferred=True))

    def turn() -> None:  # a rollout turn without a train phase after it (an evaluation)
        with ts.rollout_turn():
            log.append("generate")

    turn()
    assert rollout.received == []  # nothing exported yet: the engine restores its own checkpoint
    _step(ts, policy, log)  # exports w=2
    turn()  # syncs w=2
    turn()  # evaluation turn: w=2 again, the engine forgot it
    assert [float(r["w"][0]) for r in rollout.received] == [2.0, 2.0]
    policy.weight.add_(1.0)
    ts.weights.publish(policy.export_weights)  # w=3: the kept copy of w=2 is dropped
    assert ts.weights.delivered is None and ts.weights.pending is not None
    turn()
    assert [float(r["w"][0]) for r in rollout.received] == [2.0, 2.0, 3.0]
    assert ts.weights.delivered is not None and ts.weights.pending is None


def test_an_engine_that_keeps_its_weights_is_synced_once_per_export():
    log, policy, rollout, ts = _setup(enabled=True)
    _step(ts, policy, log)
    for _ in range(2):
        with ts.rollout_turn():
            pass
    assert len(rollout.received) == 1 and ts.weights.delivered is None


class FrozenModel:
    """A reward model's offload/onload, recorded."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def offload(self) -> None:
        self.log.append("offload reward model")

    def onload(self) -> None:
        self.log.append("onload reward model")


def test_a_frozen_model_leaves_the_device_for_the_engines_turn_only():
    log: list[str] = []
    policy = Engine(log, "policy", Groups(log, "mp"))
    rollout = Rollout(log)
    ts = TimeSharing([policy], rollout, torch.device("cpu"), True, WeightSync(rollout, True), frozen=[FrozenModel(log)])
    log.clear()
    _step(ts, policy, log)
    assert log == [
        "offload policy", "teardown mp", "offload reward model", "wake", "generate", "sleep",
        "recreate mp", "onload policy", "onload reward model", "train", "export policy",
    ]  # fmt: skip
    log.clear()
    rollout_off = Rollout(log)
    off = TimeSharing([policy], rollout_off, torch.device("cpu"), False, WeightSync(rollout_off, False), frozen=[FrozenModel(log)])
    _step(off, policy, log)
    assert "offload reward model" not in log and "onload reward model" not in log
