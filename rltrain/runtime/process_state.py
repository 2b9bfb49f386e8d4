"""Process-global state a run leaves behind, reset so the next in-process run starts clean.

A Hydra multirun (`python -m rltrain -m ...`) runs its jobs one after the other in one process, so
what one job sets in module globals (process groups, megatron-core's state, deterministic mode,
environment variables) must not leak into the next. The list:
docs/internals/runtime.md.
"""

from __future__ import annotations

import gc
import os
import sys

# A whole-heap collection owed by a closed CPU engine (rltrain/rollout/vllm.py): settled before the
# next run or engine of this process allocates, and never made where the process ends first.
_COLLECTION_OWED = [False]


def owe_collection() -> None:
    """Leave the collection that frees a closed engine to whatever this process builds next. A run
    closes its engine last, and most processes end right after it: a walk over a heap that holds
    torch, transformers and vLLM, for memory nothing would use."""
    _COLLECTION_OWED[0] = True


def settle_owed_collection(always: bool = False) -> None:
    """Collect the heap where a closed engine left that owed (before a run or an engine builds), or
    `always` (the collection a caller needs anyway settles it)."""
    if _COLLECTION_OWED[0] or always:
        _COLLECTION_OWED[0] = False
        gc.collect()


def reset_process_state() -> None:
    """Undo the module-global state of a finished run (idempotent; cheap when nothing was used)."""
    if "megatron.core.parallel_state" in sys.modules:
        _reset_megatron()
    import torch

    torch.use_deterministic_algorithms(False)


def _reset_megatron() -> None:
    import torch
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()  # clears every group global; its gloo groups are destroyed if alive
    if torch.cuda.is_available():
        # The next run seeds megatron's model-parallel RNG states from its own trainer.seed.
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().reset()


def environment_snapshot() -> dict[str, str]:
    return dict(os.environ)


def restore_environment(snapshot: dict[str, str]) -> None:
    """Make os.environ equal `snapshot` again (variables a job added are removed)."""
    for key in list(os.environ):
        if key not in snapshot:
            del os.environ[key]
    for key, value in snapshot.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
