"""`trainer.precision`: one key that decides every dtype of a run.

One key instead of one per component, so weights, matmuls and gradient reduction cannot disagree;
log-probabilities, entropies and losses are fp32 whatever it says. The table of values and how
`bf16-mixed` is done under FSDP and Megatron: docs/internals/runtime.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal, get_args

import torch

# The values of `trainer.precision` (rltrain.config.schema takes them from here, beside its field).
PrecisionName = Literal["auto", "fp32", "bf16-mixed", "bf16"]  # auto: bf16-mixed on CUDA, fp32 on CPU
PRECISIONS: tuple[str, ...] = get_args(PrecisionName)


@dataclass(frozen=True)
class Precision:
    name: str  # fp32 | bf16-mixed | bf16 (never auto: resolved)
    param_dtype: torch.dtype  # master weights and optimizer state
    compute_dtype: torch.dtype  # forward/backward matmuls; also the dtype of inference copies

    @property
    def mixed(self) -> bool:
        return self.param_dtype != self.compute_dtype

    @property
    def compute_dtype_name(self) -> str:
        """The compute dtype as transformers / vLLM spell it (`float32`, `bfloat16`)."""
        return str(self.compute_dtype).removeprefix("torch.")

    def autocast(self, device: torch.device | str) -> contextlib.AbstractContextManager:
        """Where weights are kept in fp32 but used in bf16 without a framework casting them (one
        unsharded FSDP rank, every megatron stage): autocast to the compute dtype. Otherwise
        (fp32, pure bf16) nothing."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=self.compute_dtype)


def resolve_precision(name: str, device: torch.device | str) -> Precision:
    """The concrete precision for `trainer.precision` on `device` (`auto` picks per device type)."""
    if name not in PRECISIONS:
        raise ValueError(f"trainer.precision={name!r}: expected one of {', '.join(PRECISIONS)}")
    if name == "auto":
        name = "bf16-mixed" if torch.device(device).type == "cuda" else "fp32"
    if name == "fp32":
        return Precision(name, torch.float32, torch.float32)
    if name == "bf16-mixed":
        return Precision(name, torch.float32, torch.bfloat16)
    return Precision(name, torch.bfloat16, torch.bfloat16)
