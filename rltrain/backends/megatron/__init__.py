"""The megatron-core training backend (TP x PP x DP), usable on CPU over gloo: the engine is
`engine.MegatronEngine`, one module per concern beside it. Importing this package pulls in nothing
from megatron; it installs, once, the filters for megatron-core's known warnings (matched by exact
message, so a new one still shows). docs/internals/backends.md lists them and why each is noise.
"""

from __future__ import annotations

import logging
import warnings

MEGATRON_NOISE = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
    r".*CUDA_DEVICE_MAX_CONNECTIONS",
)
MEGATRON_FSDP_LOGGER = "megatron.core.distributed.fsdp"
# torch's deprecation of the collective megatron's tensor-parallel mappings call (a MoE's token
# dispatch), attributed by torch to its own c10d logger module: matched by the whole message.
MEGATRON_TORCH_NOISE = (r"`torch.distributed.all_gather_into_tensor` is deprecated",)


def silence_megatron_noise() -> None:
    """Ignore megatron-core's known, harmless warnings (see the module docstring). Idempotent:
    `filterwarnings` moves an identical filter to the front instead of adding a second copy."""
    for message in MEGATRON_NOISE:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=r"megatron\.")
    for message in MEGATRON_TORCH_NOISE:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    logging.getLogger(MEGATRON_FSDP_LOGGER).setLevel(logging.WARNING)


silence_megatron_noise()
