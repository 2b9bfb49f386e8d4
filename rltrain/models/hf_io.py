"""Loading a Hugging Face causal LM once and sharing it with every rank.

Rank 0 reads the checkpoint from disk; the other ranks build the same architecture on the meta
device, allocate it empty, and receive every parameter *and buffer* from rank 0 in a few large
flat buckets per dtype (one collective per bucket, not one per tensor). Buffers matter: rotary
`inv_freq` is a non-persistent buffer that an empty allocation leaves as garbage. Tied weights are
one Parameter object, sent once and re-tied afterwards.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def _unique_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for _, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def broadcast_module_state(model: torch.nn.Module, src: int = 0, bucket_bytes: int = 64 << 20) -> int:
    """Overwrite every parameter and buffer with `src`'s values. Returns the number of collectives."""
    tensors = _unique_tensors(model)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    collectives = 0
    for dtype in sorted(by_dtype, key=str):
        bucket: list[torch.Tensor] = []
        size = 0
        group = by_dtype[dtype]
        for i, t in enumerate(group):
            bucket.append(t)
            size += t.numel() * t.element_size()
            if size >= bucket_bytes or i == len(group) - 1:
                flat = _flatten_dense_tensors([b.data for b in bucket])
                dist.broadcast(flat, src)
                collectives += 1
                if dist.get_rank() != src:
                    for dst, val in zip(bucket, _unflatten_dense_tensors(flat, [b.data for b in bucket])):
                        with torch.no_grad():
                            dst.data.copy_(val)
                bucket, size = [], 0
    return collectives


def load_causal_lm(model_dir: Path, dtype: torch.dtype, bucket_mb: int = 64) -> torch.nn.Module:
    """The model at `model_dir` on every rank; read from disk by rank 0 only."""
    from transformers import AutoConfig, AutoModelForCausalLM

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1 or dist.get_rank() == 0:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa")
    else:
        config = AutoConfig.from_pretrained(str(model_dir))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        model.to_empty(device="cpu")
        # to_empty allocates per module and so splits tied weights; re-tie before receiving so both
        # sides enumerate the same unique tensors.
        model.tie_weights()
    if world > 1:
        broadcast_module_state(model, 0, bucket_mb << 20)
    model.config.use_cache = False
    return model
