"""Make megatron-core 0.16 run on a CPU-only torch build (gloo), touching as little as possible.

megatron-core assumes CUDA in a handful of places on the local GPT path; each is patched here, in
one module, and only when CUDA is absent, so on a GPU machine megatron runs exactly as shipped.
docs/internals/backends.md lists every patched spot.
"""

from __future__ import annotations

import operator
import types
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
    from megatron.core.transformer.moe.moe_utils import RouterGatingLinearFunction

    linears = (layers.LinearWithGradAccumulationAndAsyncCommunication, layers.LinearWithFrozenWeight)
    for fn in (*linears, RouterGatingLinearFunction):
        forward, backward = fn.forward, fn.backward

        def fwd(ctx: Any, *args, _forward=forward, **kwargs):
            ctx.rltrain_cpu_autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
            return _forward(ctx, *args, **kwargs)

        def bwd(ctx: Any, *grads, _backward=backward):
            enabled, dtype = ctx.rltrain_cpu_autocast
            with torch.autocast("cpu", dtype=dtype, enabled=enabled):
                return _backward(ctx, *grads)

        fn.forward, fn.backward = staticmethod(fwd), staticmethod(bwd)


def _patch_moe() -> None:
    """megatron's MoE path (router, all-to-all dispatcher, the tensor-parallel mappings it uses)
    on the CPU: the same arithmetic and collectives, without the CUDA device and streams it names."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, router, token_dispatcher

    # `mappings` allocates its collective outputs on `torch.cuda.current_device()`; give it a torch
    # whose current device is the CPU (every other attribute is torch's own).
    class _TorchOnCpu(types.ModuleType):
        cuda: Any
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    torch_on_cpu = _TorchOnCpu("torch")
    torch_on_cpu.cuda = types.SimpleNamespace(current_device=lambda: "cpu")
    mappings.torch = torch_on_cpu

    # Without Transformer Engine megatron never defines `te_general_gemm`; its router reads it anyway.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        # The original moves a CPU router weight to CUDA first; the rest is the same.
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return moe_utils.router_gating_linear(input, self.weight, self.bias, dtype)

    router.Router.gating = gating

    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    # Its constructor creates a CUDA stream for device-to-host copies unless one exists already;
    # on the CPU the split sizes are host tensors, so no stream is ever used.
    dispatcher.cuda_dtoh_stream = object()

    def host_splits(self, point: str, tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor | None:
        # The original copies the all-to-all split sizes to the host on a side stream; they are
        # host tensors already and only need to become the numpy arrays it hands to all_to_all.
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for attr in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, attr)
                if torch.is_tensor(value):
                    setattr(self, attr, value.numpy())
        return tokens_per_expert

    dispatcher._maybe_dtoh_and_synchronize = host_splits


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
    _patch_moe()
    _APPLIED = True
    return True
