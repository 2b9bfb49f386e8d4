"""`python -m rltrain [overrides]`: compose the config with Hydra, validate it, launch the ranks.

One entry point for one rank, `trainer.nproc=N` local ranks (rltrain.launch.local) and torchrun,
so every launch composes and checks the config the same way. In a multirun (`-m`) a failed job is
reported and the sweep goes on, exiting with the first failure's status. Multirun and submitit
details: docs/internals/launch.md; how to launch: docs/launching.md.
"""

from __future__ import annotations

import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import hydra
from omegaconf import OmegaConf

from rltrain.config.schema import CONF_DIR, Config, register_configs
from rltrain.launch.submitit_ranks import join_submitit_ranks
from rltrain.launch.sweep import JobOutcome, objective_value, sweep_exit_status
from rltrain.preflight.command_help import register_help
from rltrain.preflight.compose_errors import composition_done, reporting_composition_errors
from rltrain.preflight.hydra_mode import mode_from_the_command_line
from rltrain.runtime.errors import (
    EXIT_USER_ERROR,
    UserError,
    clear_reports,
    ensure_reported,
    format_error,
    peer_reported,
    stay_quiet_after_peer,
)
from rltrain.runtime.parent_death import DIE_WITH_PARENT_ENV, die_with_parent


class JobFailed(Exception):
    """A job ended with a non-zero exit status; what the user was told is already printed."""

    def __init__(self, code: int, message: str, interrupted: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.interrupted = interrupted  # the user stopped it (Ctrl-C, SIGTERM): a sweep stops too


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def job(cfg: Config):
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    composition_done()
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir).resolve()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if multirun and cfg.logger.wandb.group is None:
        cfg.logger.wandb.group = Path(hydra_cfg.sweep.dir).name
    if multirun and not under_torchrun():
        return sweep_job(cfg, run_dir)
    try:
        run_job(cfg, run_dir)
    except JobFailed as exc:
        sys.exit(exc.code)
    return None


def sweep_job(cfg: Config, run_dir: Path) -> JobOutcome:
    """One job of a sweep: never exits; returns its outcome (a row of the sweep summary, and the
    objective a sweeper reads)."""
    from rltrain.runtime.process_state import environment_snapshot, reset_process_state, restore_environment

    env = environment_snapshot()
    try:
        join_submitit_ranks(cfg.safety.collective_timeout_s)
        run_job(cfg, run_dir)
        return _finished(cfg, run_dir)
    except JobFailed as exc:
        if exc.interrupted:
            # Ctrl-C stops the sweep, as it does a one-rank job (whose KeyboardInterrupt Hydra
            # lets through): the user asked everything to stop, not the next job to start.
            print(f"rltrain: job {run_dir.name} was stopped; the sweep stops, later jobs do not start",
                  file=sys.stderr, flush=True)
            raise SystemExit(exc.code) from None
        outcome = JobOutcome("failed", exc.code, _first_line(exc.message))
    except SystemExit as exc:  # a library's sys.exit() inside the job ends the job, not the sweep
        code = exc.code if isinstance(exc.code, int) else 1
        if code == 0:
            return _finished(cfg, run_dir)
        outcome = JobOutcome("failed", code, f"SystemExit({exc.code!r})")
    except Exception as exc:  # noqa: BLE001 - any failure of one job is reported, the sweep goes on
        traceback.print_exc()
        outcome = JobOutcome("failed", 1, _first_line(f"{type(exc).__name__}: {exc}"))
    finally:
        reset_process_state()
        restore_environment(env)
    print(f"rltrain: job {run_dir.name} failed (exit status {outcome.exit_status}); the sweep goes on", file=sys.stderr, flush=True)
    return outcome


def _finished(cfg: Config, run_dir: Path) -> JobOutcome:
    """A job that ran to the end, with its objective (None, and a warning, when it logged none)."""
    value = objective_value(run_dir, cfg.sweep.objective, cfg.sweep.last_n)
    if value is None:
        print(
            f"rltrain: warning: job {run_dir.name} logged no finite {cfg.sweep.objective!r}, so it has no objective; "
            "set sweep.objective to a metric of metrics.jsonl (e.g. eval/accuracy, reward/mean, loss)",
            file=sys.stderr,
            flush=True,
        )
    return JobOutcome("ok", 0, objective=value, objective_key=cfg.sweep.objective)


def _first_line(text: str) -> str:
    lines = [line for line in str(text).splitlines() if line.strip()]
    line = lines[0].strip() if lines else ""
    return line.removeprefix("rltrain: error: ")


def run_job(cfg: Config, run_dir: Path) -> None:
    """Validate and run one job; raises JobFailed (after printing) when it fails."""
    from rltrain.preflight.validate import validate
    from rltrain.rewards.scoring import check_reward_needs

    try:
        validate(cfg)
        check_reward_needs(cfg)  # e.g. the code reward's sandbox tool, before any model is built
        if cfg.env.name == "agent":  # the user's code, before any engine starts (a typo costs seconds)
            from rltrain.envs.agent.episode import check_agent

            check_agent(str(cfg.env.agent))
        if cfg.env.name == "openenv":
            from rltrain.envs.openenv.check import check_openenv

            check_openenv(cfg.env)
    except UserError as exc:
        fail(exc)
    if under_torchrun():
        run_torchrun_rank(cfg, run_dir)
        return
    write_config(cfg, run_dir)
    if cfg.trainer.nproc == 1:
        from rltrain.run.trainer import run

        try:
            run(cfg, run_dir)
        except UserError as exc:
            fail(exc)
        return
    from rltrain.launch.local import run_local

    if cfg.model.path is None and cfg.model.sft_steps:
        from rltrain.models.tiny_sft import build_sft_model_dir

        try:  # here, before the ranks start: no rank waits for it at a barrier (a collective timeout)
            build_sft_model_dir(cfg.model, cfg.data, cfg.trainer)
        except UserError as exc:
            fail(exc)
    result = run_local(run_dir, cfg.trainer.nproc)
    if result.code != 0:
        raise JobFailed(result.code, result.message, interrupted=result.interrupted)


def write_config(cfg: Config, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    tmp.replace(run_dir / "config.yaml")


def run_torchrun_rank(cfg: Config, own_dir: Path) -> None:
    """Under torchrun each process composed its own run dir; all use rank 0's, which every rank,
    on every node, must see (rltrain.launch.shared_run_dir).

    A rank's UserError: the first rank to report it prints its paragraph, naming itself, and every
    rank that raised one exits 2; a rank stopped by a peer's user error exits 1 quietly."""
    from rltrain.launch.shared_run_dir import agree_on_run_dir
    from rltrain.run.trainer import run
    from rltrain.runtime.distributed import init_distributed

    dist_info = init_distributed(cfg.safety.collective_timeout_s)
    if dist_info.is_main:
        clear_reports(own_dir)  # before the agreement: no peer can report yet
        write_config(cfg, own_dir)
    try:
        run_dir = agree_on_run_dir(own_dir, dist_info)
    except UserError as exc:
        fail(exc)
    if run_dir != own_dir:
        shutil.rmtree(own_dir, ignore_errors=True)
    try:
        run(cfg, run_dir)
    except UserError as exc:
        if dist_info.world_size == 1:
            fail(exc)
        if ensure_reported(run_dir, dist_info.rank, str(exc)):
            print(format_error(str(exc), dist_info.rank), file=sys.stderr, flush=True)
        raise JobFailed(EXIT_USER_ERROR, format_error(str(exc), dist_info.rank)) from None
    except Exception:
        if dist_info.world_size > 1 and peer_reported(run_dir, dist_info.rank):
            stay_quiet_after_peer(run_dir, dist_info.rank)
            raise JobFailed(1, "stopped by a peer's error") from None
        raise


def fail(exc: UserError) -> NoReturn:
    """Print a user error's paragraph (once: on rank 0 under torchrun) and fail the job with 2."""
    message = format_error(str(exc))
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    raise JobFailed(EXIT_USER_ERROR, message)


def main() -> None:
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank: SIGKILLed torchrun must not orphan it
        die_with_parent(os.getppid())
    elif DIE_WITH_PARENT_ENV in os.environ:  # a run started by a run (the SFT start): it goes when its parent goes
        die_with_parent(int(os.environ.pop(DIE_WITH_PARENT_ENV)))
    sys.exit(compose_and_run())


def compose_and_run() -> int:
    """Compose the config from `sys.argv` and run its job (or sweep); the process's exit status."""
    register_configs()
    register_help()
    with reporting_composition_errors(), mode_from_the_command_line(sys.argv[1:]):
        hydra.main(config_path=CONF_DIR, config_name="config", version_base=None)(job)()
    return sweep_exit_status()


if __name__ == "__main__":
    main()
