"""The few widths a compiled model's packed rows are padded to.

A compiled model (flex_attention on CUDA, whose kernels and compiled `create_block_mask` are
specialised to a row's width; or `backend.compile`) compiles once per width, and a packed row's
width (a micro-batch's total, or its longest shared-prompt row) is new almost every time. Rounding
it up to one of a few widths makes compiles repeat. docs/internals/backends.md has the rule.
"""

from __future__ import annotations

# Widths are multiples of flex_attention's block (128 tokens) and, above 512, four per doubling: at
# most a quarter of a row is filler, and a 16k-token budget meets about two dozen widths in all.
WIDTH_BLOCK = 128
WIDTHS_PER_DOUBLING = 4


def packed_width(tokens: int) -> int:
    """The width a packed row of `tokens` tokens is padded to: the next multiple of
    max(WIDTH_BLOCK, 2^floor(log2 tokens) / WIDTHS_PER_DOUBLING)."""
    step = max(WIDTH_BLOCK, (1 << (max(tokens, 1).bit_length() - 1)) // WIDTHS_PER_DOUBLING)
    return -(-tokens // step) * step
