"""The offload phase hands the memory it freed back to the driver on GPU, after every engine and
frozen model has left the device and before the rollout engine wakes: torch's caching allocator
would otherwise keep it reserved, and the rollout engine (vLLM's sleep-mode allocator) allocates
from the driver (rltrain/sync/timeshare.py, `release_cached_memory`)."""

from __future__ import annotations

import torch

from rltrain.sync import timeshare
from rltrain.sync.timeshare import TimeSharing, release_cached_memory
from rltrain.sync.weight_sync import WeightSync


class Recorder:
    """An engine, a frozen model and a rollout engine in one: each call is logged."""

    weights_survive_sleep = True
    groups = None

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def offload(self) -> None:
        self.log.append("offload")

    def onload(self) -> None:
        self.log.append("onload")

    def wake(self) -> None:
        self.log.append("wake")

    def sleep(self) -> None:
        self.log.append("sleep")


def test_the_offload_phase_releases_cached_memory_before_the_engine_wakes(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(timeshare, "release_cached_memory", lambda device: log.append(f"release {device.type}"))
    unit = Recorder(log)
    ts = TimeSharing([unit], unit, torch.device("cpu"), True, WeightSync(unit, deferred=True), frozen=[unit])
    log.clear()
    with ts.rollout_turn():
        log.append("generate")
    assert log == ["offload", "offload", "release cpu", "wake", "generate", "sleep", "onload", "onload"]


def test_release_empties_torch_cache_on_cuda_only(monkeypatch):
    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    release_cached_memory(torch.device("cpu"))
    assert emptied == []
    release_cached_memory(torch.device("cuda", 0))
    assert emptied == [True]
