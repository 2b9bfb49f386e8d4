"""Torch threads per rank follow the cores the process may run on (its CPU affinity), so a rank
limited by a cpuset or `taskset` does not start more threads than it has cores."""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf

from rltrain.run.trainer import configure_threads
from rltrain.runtime.distributed import DistInfo


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_threads_follow_the_cpu_affinity_not_the_machine():
    cfg = OmegaConf.create({"trainer": {"num_threads": 0}})
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
