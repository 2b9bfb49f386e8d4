"""The megatron-core training backend (TP x PP x DP), usable on CPU over gloo.

Import `rltrain.backends.megatron.engine.MegatronEngine`; this package import itself pulls in
nothing from megatron, so a run with another backend never imports it.

It does install, once, the warnings filters for megatron-core's known noise. Every module of this
backend that imports megatron lives in this package, so this `__init__` runs before megatron's first
import anywhere in rltrain, and the filters are the one place that decides what is noise. They match
the exact messages (not the whole UserWarning category), so a new megatron warning still shows:

- "Transformer Engine and Apex are not installed" / "Apex is not installed": the fallbacks to torch
  kernels that this backend uses on purpose (the local layer spec, torch AdamW).
- "full scope is deprecated": megatron 0.16's own TransformerConfig default for `cuda_graph_scope`;
  the backend captures no CUDA graphs.
- "CUDA_DEVICE_MAX_CONNECTIONS": advice for overlapping async TP all-reduces on CUDA streams,
  emitted at every first forward even on CPU; it is a speed hint, not a correctness matter.
- Megatron-FSDP's INFO lines at import ("Using Megatron-FSDP without Transformer Engine",
  "Detected Megatron Core, using Megatron-FSDP with Megatron"): `megatron.core.distributed` imports
  it, this backend does not use it, and Hydra's root logger would print them at INFO. Its logger is
  set to WARNING, so its warnings still show.
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


def silence_megatron_noise() -> None:
    """Ignore megatron-core's known, harmless warnings (see the module docstring). Idempotent:
    `filterwarnings` moves an identical filter to the front instead of adding a second copy."""
    for message in MEGATRON_NOISE:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=r"megatron\.")
    logging.getLogger(MEGATRON_FSDP_LOGGER).setLevel(logging.WARNING)


silence_megatron_noise()
