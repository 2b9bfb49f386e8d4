"""`trainer.precision`: one key that decides every dtype of a run.

| value | weights and optimizer state | matmuls | gradient reduction |
| --- | --- | --- | --- |
| `auto` (default) | `bf16-mixed` on CUDA, `fp32` on CPU | | |
| `fp32` | fp32 | fp32 | fp32 |
| `bf16-mixed` | fp32 (master copy) | bf16 | fp32 |
| `bf16` | bf16 (opt-in: no fp32 master weights) | bf16 | bf16 |

Whatever the precision, log-probabilities, entropies and losses are computed in fp32 (the output
head's logits are upcast before the log-softmax). Inference copies of the policy (the rollout
engine, evaluation) run in the compute dtype. `auto` resolves to `fp32` on CPU because a CPU has
no fast bf16 path here and CPU tests pin numbers to fp32 round-off. This key replaces the former
`model.dtype`: the model's own files are read into `param_dtype` (the tiny model is stored fp32).

How `bf16-mixed` is done:

- FSDP, sharded: FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`. The fp32
  shards are the master weights; each unit all-gathers them in bf16 and computes in bf16
  (activations included), gradients are reduce-scattered in fp32 into fp32 shards, AdamW steps
  fp32.
- FSDP, one rank (not wrapped, nothing to cast): the model runs under `autocast` (below). Matmuls
  are bf16; embeddings, RMSNorm and the residual stream stay fp32, a little more precise than the
  sharded path, so 1 and N ranks agree to bf16 round-off here, not to fp32's as in `fp32`.
- megatron: fp32 parameters and each pipeline stage's forward under `autocast` (megatron's linear
  layers then compute in bf16; its residual stream turns bf16 after the first layer, as in
  megatron's own bf16 training). Activations cross between stages in fp32.

Activation checkpointing (`model.gradient_checkpointing`) recomputes under the same autocast
state, so it changes no number in any precision.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import get_args

import torch

from rltrain.config.schema import Precision

PRECISIONS: tuple[str, ...] = get_args(Precision)


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
