"""What an in-process vLLM changes for its whole process, and how rltrain's engine keeps it: the
RNG states and torch's threads its construction touches (`ProcessStateGuard`), the full-heap
collections its construction and shutdown run (`heap_frozen_for_construction`,
`collections_deferred`), its teardown of the default process group when a trainer owns it
(`destroy_vllm_world_only`) and the CPU build's kernel overrides, registered once
(`register_kernel_overrides_once`). docs/internals/rollout.md.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rltrain.runtime.process_state import settle_owed_collection


class ProcessStateGuard:
    """Restores what an in-process vLLM changes globally: the Python, NumPy and torch RNG states
    (construction seeds them; even seeded generation draws from torch's), and torch threading."""

    def __enter__(self) -> ProcessStateGuard:
        import numpy as np

        self.states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
        self.set_num_threads = torch.set_num_threads
        self.num_threads = torch.get_num_threads()
        return self

    def __exit__(self, *exc: object) -> None:
        import numpy as np

        py_state, np_state, torch_state = self.states
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.random.set_rng_state(torch_state)
        torch.set_num_threads = self.set_num_threads
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)


@contextmanager
def collections_deferred() -> Iterator[None]:
    """vLLM's shutdown unfreezes the heap and collects all of it three times (the model runner,
    the engine core, the distributed teardown), each a walk over every object of a process that
    holds torch, transformers and vLLM. On the CPU build nothing runs between those collections
    that needs the memory back (emptying the CUDA cache is a no-op), so they are skipped and
    `close` collects once, after the engine is dropped. Process-wide while it lasts, like the
    teardown it wraps."""
    collect = gc.collect
    gc.collect = _no_collection
    try:
        yield
    finally:
        gc.collect = collect


@contextmanager
def heap_frozen_for_construction(cpu: bool) -> Iterator[None]:
    """vLLM walks the whole heap five times while it builds an engine: two collections after loading
    the weights (for a CUDA allocator) and three before it freezes the heap as static. On the CPU
    build the heap is collected once here (settling a closed engine's owed collection,
    rltrain.runtime.process_state) and frozen, so those walk only what the construction allocates;
    vLLM freezes the same survivors. A construction that fails leaves the heap unfrozen."""
    if not cpu:
        yield
        return
    settle_owed_collection(always=True)
    gc.freeze()
    try:
        yield
    except BaseException:
        gc.unfreeze()
        raise


def _no_collection(generation: int = 2) -> int:
    return 0


def destroy_vllm_world_only() -> None:
    """vLLM's `destroy_distributed_environment` minus destroying the default process group."""
    from vllm.distributed import parallel_state

    if parallel_state._WORLD is not None:
        parallel_state._WORLD.destroy()
    parallel_state._WORLD = None
    parallel_state._NODE_COUNT = None


def register_kernel_overrides_once() -> None:
    """vLLM's CPU build registers its C++ stand-ins for Triton kernels each time it builds an engine,
    each time scanning every loaded module's namespace for the kernels (half a second beside torch,
    transformers and vLLM). Registered once, they stay: later engines of the process skip it."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    if current_platform.device_type != "cpu":
        return
    platform = type(current_platform)
    register = platform.register_triton_kernel_overrides
    if getattr(register, "once", False):
        return

    def once(cls) -> None:
        if not dispatcher._registry:
            register()

    once.once = True  # type: ignore[attr-defined]
    platform.register_triton_kernel_overrides = classmethod(once)
