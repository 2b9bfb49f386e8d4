"""Make megatron-core 0.16 run on a CPU-only torch build (gloo), touching as little as possible.

megatron-core assumes CUDA in a handful of places on the local GPT path; each is patched here, in
one module, and only when CUDA is absent, so on a GPU machine megatron runs exactly as shipped.
docs/internals/backends.md lists every patched spot.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from contextlib import nullcontext
from functools import reduce
from typing import Any

import torch

_APPLIED = False


def _cpu_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context: Callable | None = None) -> torch.Tensor:
    """Same contract as `GlobalMemoryBuffer.get_tensor`, with the buffer on the CPU."""
    required_len = reduce(operator.mul, tensor_shape, 1)
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < required_len:
        with (mem_alloc_context or nullcontext)():
            buf = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
        self.buffer[(name, dtype)] = buf
    return buf[:required_len].view(*tensor_shape)


def _patch_rotary() -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    original = RotaryEmbedding.get_emb

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        # The original only differs by moving a CPU `inv_freq` to CUDA before computing; with
        # `inv_freq` already on its final (CPU) device it takes no CUDA path, so hide the move by
        # computing the embedding the same way it does.
        if self.inv_freq.device.type != "cpu":
            return original(self, max_seq_len, offset)
        freqs_SD = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb_SD = torch.cat((freqs_SD, freqs_SD), dim=-1)
        else:
            emb_SD = torch.stack((freqs_SD.view(-1, 1), freqs_SD.view(-1, 1)), dim=-1).view(freqs_SD.shape[0], -1)
        return emb_SD[:, None, None, :]

    RotaryEmbedding.get_emb = get_emb


def _patch_tied_output_setup() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self) -> None:
        # Run the original with the embedding-group all-reduce switched off (that is where it calls
        # `.cuda()`), then do the same all-reduce on the CPU tensor.
        in_group = torch.distributed.is_initialized() and self._is_in_embd_group()
        self._is_in_embd_group = lambda: False
        try:
            original(self)
        finally:
            del self._is_in_embd_group
        shares = self.share_embeddings_and_output_weights or getattr(self.config, "mtp_num_layers", 0)
        if in_group and shares and self.config.pipeline_model_parallel_size > 1:
            torch.distributed.all_reduce(self.shared_embedding_or_output_weight().data, group=self.embd_group)

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def _patch_linear_autocast() -> None:
    from megatron.core.tensor_parallel import layers

    for fn in (layers.LinearWithGradAccumulationAndAsyncCommunication, layers.LinearWithFrozenWeight):
        forward, backward = fn.forward, fn.backward

        def fwd(ctx: Any, *args, _forward=forward, **kwargs):
            ctx.rltrain_cpu_autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
            return _forward(ctx, *args, **kwargs)

        def bwd(ctx: Any, *grads, _backward=backward):
            enabled, dtype = ctx.rltrain_cpu_autocast
            with torch.autocast("cpu", dtype=dtype, enabled=enabled):
                return _backward(ctx, *grads)

        fn.forward, fn.backward = staticmethod(fwd), staticmethod(bwd)


def apply_cpu_shims() -> bool:
    """Patch megatron-core for a CPU-only run; a no-op when CUDA is available. Idempotent.

    Returns whether the shims are active. Call before building a model or initialising megatron's
    parallel state (the RNG tracker is set up here).
    """
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    from megatron.core import tensor_parallel
    from megatron.core.utils import GlobalMemoryBuffer

    GlobalMemoryBuffer.get_tensor = _cpu_get_tensor
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _patch_rotary()
    _patch_tied_output_setup()
    _patch_linear_autocast()
    _APPLIED = True
    return True
