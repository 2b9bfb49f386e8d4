"""vLLM's sampler on its CPU build, without its one compiled helper (docs/internals/rollout.md).

vLLM 0.32 ranks each sampled token within its vocabulary row with `batched_count_greater_than`,
a `torch.compile`d function. On the CPU build the first generate of every engine process traces it
and loads, or builds with a C++ compiler, an inductor kernel: seconds of CPU per process (each run,
each rank, each separate engine and server) and a compiler on the machine. The eager expression
counts the same integers; what the kernel saves is a [rows, vocab] boolean temporary, which a
CPU's memory holds. Accelerators keep vLLM's kernel.
"""

from __future__ import annotations

import torch


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of `x` [rows, vocab], how many entries are >= that row's value in `values` [rows, 1]:
    vLLM's `batched_count_greater_than`, uncompiled."""
    return (x >= values).sum(-1)


def use_eager_rank_count() -> None:
    """On vLLM's CPU build, the sampler ranks tokens with `count_at_least` (call before the first
    generate of the process that samples: the in-process engine's, or a server's)."""
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        return
    import vllm.v1.sample.sampler as sampler

    sampler.batched_count_greater_than = count_at_least
