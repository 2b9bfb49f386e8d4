"""Which errors a zero backward may stand in for, and which it never may.

Recovery (`safety.fail_fast=false`) is for errors that depend on the values of one micro-batch or
on a moment in time. A lost peer (`is_collective_failure`) and a bug in the program
(`is_programming_error`: wrong device, dtype or shape, recurring on every micro-batch) are passed
through at once in both modes, so a bug is never hidden behind an error count. The full rule, with
the messages matched and what is deliberately left out: docs/internals/safety.md.
"""

from __future__ import annotations

import re

import torch


def is_collective_failure(exc: BaseException) -> bool:
    """A lost peer or a timed-out collective: never recoverable by a zero loss (the peers are gone
    or elsewhere), so the guard lets it through."""
    if isinstance(exc, torch.distributed.DistError):
        return True
    text = str(exc)
    return any(
        marker in text
        for marker in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL error", "Timed out")
    )


# Errors that name the program, not the data (module docstring).
_PROGRAMMING_ERROR_TYPES = (TypeError, AttributeError, NameError, NotImplementedError)
_MESSAGE_TYPES = (RuntimeError, ValueError, IndexError)
_PROGRAMMING_ERROR_MESSAGES = re.compile(
    "|".join(
        (
            # device
            r"Expected all tensors to be on the same device",
            r"is not on the expected device",
            r"but expected (?:it|them) to be on",
            r"to have the same device",
            r"expected device \S+ but got",
            r"on the same device as the indexed tensor",
            r"Expected a '\w+' device type",
            r"Input type \(.*\) and (?:weight|bias) type \(.*\) should be the same",
            r"device-side assert triggered",
            r"illegal memory access",
            # dtype
            r"[Ee]xpected scalar type",
            r"Expected object of scalar type",
            r"to have one of the following scalar types",
            r"to have the same dtype",
            r"dtype to be equal to",
            r"must have the same (?:scalar type|dtype)",
            r"dtypes match",
            r"can't be cast to the desired output type",
            r"[Ee]xpected (?:\w+ )?dtype",
            r"Found dtype \w+ but expected",
            r"not implemented for '\w+'",
            # shape
            r"The size of tensor a \(\d+\) must match the size of tensor b",
            r"shape '\[[^\]]*\]' is invalid for input of size",
            r"shapes cannot be multiplied",
            r"Sizes of tensors must match",
            r"The expanded size of the tensor",
            r"doesn't match the broadcast shape",
            r"Mismatch in shape",
            r"Dimension out of range",
            r"Expected size for first two dimensions",
            r"batch_size \(\d+\) to match target batch_size",
            r"size mismatch",
        )
    )
)


def is_programming_error(exc: BaseException) -> bool:
    """A bug in the program: a device, dtype or shape mismatch between tensors, or Python's
    TypeError/AttributeError/NameError/NotImplementedError (module docstring). It would recur on
    every step, so no mode recovers it. The error and the errors it was raised `from` are checked."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, _PROGRAMMING_ERROR_TYPES):
            return True
        if isinstance(current, _MESSAGE_TYPES) and _PROGRAMMING_ERROR_MESSAGES.search(str(current)):
            return True
        current = current.__cause__
    return False
