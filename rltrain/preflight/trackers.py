"""`logger.backends`: known trackers, each named once, each installed, checked before any model is
built, so a missing tracker is one paragraph with its install command, not an ImportError at step 0.
The trackers and their pip requirements: rltrain.run.trackers (docs/trackers.md)."""

from __future__ import annotations

from typing import get_args

from rltrain.config.schema import Config, TrackerName
from rltrain.runtime.errors import UserError, require_extra


def validate_trackers(cfg: Config) -> None:
    from rltrain.run.trackers import TRACKERS

    backends = list(cfg.logger.backends)
    known = get_args(TrackerName)
    if unknown := [name for name in backends if name not in known]:
        raise UserError(f"logger.backends names {', '.join(map(repr, unknown))}: the trackers are {', '.join(known)} (any subset, e.g. logger.backends=[wandb,tensorboard]).")
    if len(set(backends)) < len(backends):
        raise UserError(f"logger.backends={backends} names a tracker twice: name each once.")
    for name in backends:
        spec = TRACKERS[name]
        require_extra(spec.module, f"logger.backends names {name}", spec.install, name, f"leave {name} out of logger.backends")
