"""Torch threads per rank follow the cores the process may run on (its CPU affinity), so a rank
limited by a cpuset or `taskset` does not start more threads than it has cores."""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf

from rltrain.config.schema import Config
from rltrain.run.trainer import configure_threads
from rltrain.runtime.distributed import DistInfo


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_threads_follow_the_cpu_affinity_not_the_machine():
    cfg = OmegaConf.structured(Config)  # no rollout engine (SFT, DPO): the trainer takes every core
    allowed, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        os.sched_setaffinity(0, {min(allowed)})
        configure_threads(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
        assert torch.get_num_threads() == 1
        cfg.trainer.num_threads = 3  # an explicit count is taken as given
        configure_threads(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
        assert torch.get_num_threads() == 3
    finally:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(threads)


def _split(trainer=0, engine=0, k=0, world_size=1, cores=8):
    from rltrain.runtime.threads import thread_split

    return thread_split(trainer, engine, k >= 1, world_size, cores)


def test_generating_ahead_splits_the_ranks_cores_between_trainer_and_engine():
    assert _split(world_size=1, cores=8) == (8, 8)  # synchronous: they take turns
    assert _split(world_size=2, cores=8) == (4, 4)
    assert _split(engine=2, world_size=1, cores=8) == (8, 2)
    assert _split(k=1, world_size=1, cores=8) == (4, 4)  # side by side: half each
    assert _split(k=1, world_size=1, cores=2) == (1, 1)
    assert _split(k=1, world_size=2, cores=2) == (1, 1)  # never below one thread
    assert _split(k=2, engine=3, world_size=1, cores=8) == (5, 3)
    assert _split(k=1, trainer=6, world_size=1, cores=8) == (6, 2)
    assert _split(k=1, trainer=3, engine=3, world_size=1, cores=2) == (3, 3)  # explicit counts stand
