"""How a prompt's samples are seeded, shared by every vLLM path (in-process `vllm.py`, the separate
process's in-flight loop, the server fleet) so that a prompt samples the same completions whichever
engine generates it. Pure arithmetic: importing it costs nothing (no torch, no vLLM).
"""

from __future__ import annotations


def request_seed(call_seed: int, prompt_index: int, n: int) -> int:
    """The vLLM seed of prompt `prompt_index`: vLLM gives its `n` children seed, seed+1, ...,
    so prompts are spaced `n` apart and identical prompts in one call still differ."""
    return (call_seed * 1_000_003 + prompt_index * max(n, 1)) % (2**31 - 1)


def retry_seed(seed: int) -> int:
    """The seed of a group generated again (too stale for any batch, docs/async.md): a function of
    the attempt's own seed, so the retry samples afresh and a deterministic run still repeats."""
    return (seed * 7_919 + 104_729) % (2**31 - 1)
