"""Imported by the fork server and the rank server (helpers.PRELOAD) just before `heap_frozen`: one
tiny `torch.compile`, so what inductor does once per process (hashing torch's and triton's sources
for its cache keys, probing the CPU's vector instruction sets, building its decomposition and
pattern tables) is done once per server, not in every forked process that compiles. (vLLM's sampler
compiles nothing on the CPU build: rltrain/rollout/vllm_cpu_sampler.py.)

Forking after it stays safe: static shapes too small for a parallel kernel (no OpenMP threads), one
compile thread (no worker pool), tqdm's monitor thread off; checked. The environment is left as found
(inductor writes a pointer into it for each kernel it loads). docs/testing.md, "Start-up".
"""

import os
import time

import torch
import tqdm


def _threads() -> list[str]:
    return sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task"))


def compile_before_fork(compile_and_run) -> None:
    """Run `compile_and_run` (a first call of a compiled function) in a process that forks workers
    after it: one compile thread, tqdm's monitor off, the environment put back; raises if a thread
    it started outlives it by more than a moment. A missing C++ compiler leaves nothing warm."""
    before, environment = _threads(), dict(os.environ)
    monitor_interval, tqdm.tqdm.monitor_interval = tqdm.tqdm.monitor_interval, 0
    try:
        with torch._inductor.config.patch(compile_threads=1):
            compile_and_run()
    except Exception:  # noqa: BLE001 - no C++ compiler: nothing to warm (the compile tests fail there themselves)
        pass
    finally:
        tqdm.tqdm.monitor_interval = monitor_interval
        os.environ.clear()
        os.environ.update(environment)
    deadline = time.monotonic() + 5  # a compile of dynamic shapes leaves a native thread for a moment
    while _threads() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    if _threads() != before:
        raise RuntimeError(f"warming the compiler left threads behind ({before} -> {_threads()}): forking is unsafe")


def _count_at_least() -> None:
    count_at_least = torch.compile(lambda x, v: (x >= v).sum(-1), backend="inductor", dynamic=False)
    count_at_least(torch.arange(6.0).reshape(2, 3), torch.ones(2, 1))


compile_before_fork(_count_at_least)
