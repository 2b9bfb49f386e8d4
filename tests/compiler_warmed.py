"""Imported by the fork server and the rank server (helpers.PRELOAD) just before `heap_frozen`: one
tiny `torch.compile`, so what inductor does once per process (hashing torch's and triton's sources
for its cache keys, probing the CPU's vector instruction sets by compiling and loading test
programs, building its decomposition and pattern tables) is done once per server, not in every
forked process that compiles: each vLLM engine compiles its sampler's rank count on its first step.

Forking after it stays safe: static shapes too small for a parallel kernel (no OpenMP threads), one
compile thread (no worker pool), tqdm's monitor thread off; checked below. The environment is left as
found (inductor writes a pointer into it for each kernel it loads, and sets it again for the next).
docs/testing.md, "Start-up".
"""

import os

import torch
import tqdm


def _threads() -> list[str]:
    return sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task"))


def _warm() -> None:
    before, environment = _threads(), dict(os.environ)
    monitor_interval, tqdm.tqdm.monitor_interval = tqdm.tqdm.monitor_interval, 0
    try:
        with torch._inductor.config.patch(compile_threads=1):
            count_at_least = torch.compile(lambda x, v: (x >= v).sum(-1), backend="inductor", dynamic=False)
            count_at_least(torch.arange(6.0).reshape(2, 3), torch.ones(2, 1))
    except Exception:  # noqa: BLE001 - no C++ compiler: nothing to warm (the compile tests fail there themselves)
        pass
    finally:
        tqdm.tqdm.monitor_interval = monitor_interval
        os.environ.clear()
        os.environ.update(environment)
    if _threads() != before:
        raise RuntimeError(f"warming the compiler left threads behind ({before} -> {_threads()}): forking is unsafe")


_warm()
