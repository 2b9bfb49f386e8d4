"""`python -m rltrain [overrides]`: compose the config with Hydra, validate it, launch the ranks.

One rank runs in this process; `trainer.nproc=N` spawns N local ranks (rltrain.launch); under
`torchrun` every process is already a rank and trains directly, sharing rank 0's run directory.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import hydra
from omegaconf import OmegaConf

from rltrain.config import register_configs
from rltrain.errors import UserError

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def job(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from rltrain.validate import validate

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir).resolve()
    try:
        validate(cfg)
    except UserError as exc:
        fail(exc)
    if hydra_cfg.mode == RunMode.MULTIRUN and cfg.logger.wandb.group is None:
        cfg.logger.wandb.group = Path(hydra_cfg.sweep.dir).name
    if under_torchrun():
        run_torchrun_rank(cfg, run_dir)
        return
    write_config(cfg, run_dir)
    if cfg.trainer.nproc == 1:
        from rltrain.trainer import run

        try:
            run(cfg, run_dir)
        except UserError as exc:
            fail(exc)
        return
    from rltrain.launch import spawn_local

    code = spawn_local(run_dir, cfg.trainer.nproc)
    if code != 0:
        sys.exit(code)


def write_config(cfg, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    tmp.replace(run_dir / "config.yaml")


def run_torchrun_rank(cfg, own_dir: Path) -> None:
    """Under torchrun each process composed its own run dir; all use rank 0's."""
    from rltrain.distributed import broadcast_str, init_distributed
    from rltrain.trainer import run

    dist_info = init_distributed(cfg.safety.collective_timeout_s)
    run_dir = Path(broadcast_str(str(own_dir) if dist_info.is_main else None))
    if dist_info.is_main:
        write_config(cfg, run_dir)
    elif run_dir != own_dir:
        shutil.rmtree(own_dir, ignore_errors=True)
    try:
        run(cfg, run_dir)
    except UserError as exc:
        fail(exc)


def fail(exc: UserError) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"rltrain: error: {exc}", file=sys.stderr, flush=True)
    sys.exit(2)


def main() -> None:
    register_configs()
    hydra.main(config_path=CONF_DIR, config_name="config", version_base=None)(job)()


if __name__ == "__main__":
    main()
