"""Silencing third-party console output that a user of rltrain cannot act on.

Each item is matched at its source and narrowly (a progress bar by its description, a warning by
its message and the module it is attributed to, one library's logger), so anything new from these
libraries still shows:

- transformers' "Loading weights" and "Writing model shards" bars: every rank draws one for every
  local checkpoint it reads or writes (policy, reference, final export), in a fraction of a second
  for the tiny model, and `rltrain: model <dir>` already says what is loaded. The trainer hides
  them on every rank but 0, and on rank 0 too for the embedded model; a user's `model.path` can
  take minutes to load, so rank 0 keeps its bars (rltrain.run.trainer.run). Hugging Face Hub
  download bars, which do tell a user something, are left alone. (vLLM's own loading bar is off
  by its engine argument, rltrain.rollout.vllm_args.)
- vLLM's import-time log lines ("Triton is installed, but doesn't include CPU backend", ...): vLLM
  configures its own logger only when an engine starts, so what it logs while being imported
  reaches the root logger (Hydra's console handler and the run's `<job>.log`) at INFO. The `vllm`
  logger gets, before the import, the level `VLLM_LOGGING_LEVEL` asks for (rltrain.rollout sets
  ERROR unless the user chose another).
- vLLM's FutureWarning "`torch.distributed.reduce_op` is deprecated": its triton dispatcher looks
  at every attribute of torch.distributed when it is imported.
W&B's Weave advert is switched off where W&B starts (rltrain.run.metrics_log.start_wandb), and
megatron-core's known warnings are silenced by its backend package (rltrain.backends.megatron),
which is imported only when that backend runs.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

QUIET_TRANSFORMERS_BARS = frozenset({"Loading weights", "Writing model shards"})
VLLM_IMPORT_WARNINGS = (r"`torch\.distributed\.reduce_op` is deprecated",)


def quiet_transformers_checkpoint_bars() -> None:
    """Hide transformers' bars for local checkpoint reads and writes, through its tqdm hook. A hook
    already installed (by the user) keeps running for every bar. Idempotent."""
    from transformers.utils import logging as hf_logging

    previous = hf_logging.set_tqdm_hook(None)
    if isinstance(previous, _CheckpointBarFilter):
        previous = previous.previous
    hf_logging.set_tqdm_hook(_CheckpointBarFilter(previous))


class _CheckpointBarFilter:
    """A transformers tqdm hook: bars named in QUIET_TRANSFORMERS_BARS are created disabled."""

    def __init__(self, previous: Callable[..., Any] | None) -> None:
        self.previous = previous

    def __call__(self, factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kwargs.get("desc") in QUIET_TRANSFORMERS_BARS:
            kwargs = {**kwargs, "disable": True}
        if self.previous is not None:
            return self.previous(factory, args, kwargs)
        return factory(*args, **kwargs)


def quiet_vllm_import() -> None:
    """Call before vLLM is first imported: its import-time log lines obey `VLLM_LOGGING_LEVEL`, and
    its known deprecation warning is ignored (see the module docstring). Idempotent."""
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    logging.getLogger("vllm").setLevel(level)
    for message in VLLM_IMPORT_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=r"vllm\.")
