"""Entry point of one rank started by `rltrain.launch`: read the run's config.yaml and train."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from rltrain.errors import UserError


def load_run_config(run_dir: Path):
    from rltrain.config import Config

    return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(run_dir / "config.yaml"))


def main(argv: list[str]) -> int:
    run_dir = Path(argv[1])
    cfg = load_run_config(run_dir)
    from rltrain.trainer import run

    try:
        run(cfg, run_dir)
    except UserError as exc:
        import os

        if os.environ.get("RANK", "0") == "0":
            print(f"rltrain: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
