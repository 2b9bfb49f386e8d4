"""Silencing third-party console output that a user of rltrain cannot act on.

Each item is matched at its source and narrowly (a progress bar by its description, a warning by
its message and module, one library's logger), so anything new from these libraries still shows.
What is silenced, where, and why: docs/internals/runtime.md.
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


# datasets, reading a Hub dataset's prepared copy offline, says so at WARNING on every load; the
# launcher's load (rltrain/preflight/validate.py) shows it once, each rank's reload need not.
DATASETS_OFFLINE_NOTES = ("Using the latest cached version of the dataset", "Found the latest cached dataset configuration")


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_datasets_offline_notes() -> None:
    """Drop datasets' "using the cached copy" notes (DATASETS_OFFLINE_NOTES) from its two loggers.
    Idempotent."""
    for name in ("datasets.load", "datasets.packaged_modules.cache.cache"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(DATASETS_OFFLINE_NOTES))


def quiet_vllm_import() -> None:
    """Call before vLLM is first imported: its import-time log lines obey `VLLM_LOGGING_LEVEL`, and
    its known deprecation warning is ignored (see the module docstring). Idempotent."""
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    logging.getLogger("vllm").setLevel(level)
    for message in VLLM_IMPORT_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=r"vllm\.")
