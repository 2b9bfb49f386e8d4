"""The training loop of one rank: set up, resume, step, evaluate, checkpoint, export.

The loop is algorithm-agnostic: the algorithm turns `train_step(step)` into one optimizer step
and returns metrics that are already identical on every rank; the loop adds timing, writes rows,
runs evaluation every `trainer.eval_every` steps and at the end, saves atomic checkpoints every
`trainer.save_every` steps and writes `final/` as a Hugging Face model directory; rank 0 then draws
the run's curves into `plots.png` (rltrain.run.curves).
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rltrain.backends.roles import resolve_role_dirs
from rltrain.config.algorithms import spec_of
from rltrain.config.group_choice import as_option
from rltrain.config.group_options import VLLMRolloutConfig
from rltrain.config.run_context import RunContext
from rltrain.config.schema import Config
from rltrain.models.lora import MERGED_DIR
from rltrain.models.model_dir import resolve_model_dir
from rltrain.models.vision import copy_processor_files
from rltrain.run.algorithm import Algorithm
from rltrain.run.checkpoint import CheckpointManager, fingerprint, fsync_path
from rltrain.run.curves import write_run_plot
from rltrain.run.evaluate_only import evaluate_only
from rltrain.run.metrics_log import MetricsLogger
from rltrain.run.safety_services import SafetyServices
from rltrain.runtime.distributed import DistInfo, barrier, init_distributed
from rltrain.runtime.errors import UserError, report_user_error
from rltrain.runtime.library_noise import quiet_transformers_checkpoint_bars
from rltrain.runtime.process_state import reset_process_state, settle_owed_collection
from rltrain.runtime.threads import thread_split
from rltrain.safety.faults import FaultInjector, parse_faults


def build_algorithm(ctx: RunContext) -> Algorithm:
    """The algorithm its declaration names (rltrain.config.algorithms)."""
    return spec_of(ctx.cfg.algo.name).impl(ctx)


def configure_threads(cfg: Config, dist_info: DistInfo) -> None:
    """The trainer's share of the rank's cores (rltrain.runtime.threads); only a vLLM engine in a
    process of its own has threads of its own."""
    vllm = as_option("rollout", cfg.rollout, VLLMRolloutConfig)
    engine_threads = vllm.num_threads if vllm is not None and vllm.process == "separate" else 0
    overlapped = cfg.placement.max_staleness >= 1
    torch.set_num_threads(thread_split(cfg.trainer.num_threads, engine_threads, overlapped, dist_info.world_size)[0])


def seed_everything(seed: int, rank: int) -> None:
    random.seed(seed + rank)
    torch.manual_seed(seed + rank)


def prepare_model_dir(cfg: Config, dist_info: DistInfo) -> Path:
    """Rank 0 builds the tiny model (and its SFT start, model=tiny_sft) if needed before the
    others read it from the cache. The local launcher builds the SFT start before it starts the
    ranks; under torchrun the barrier waits for rank 0's build, which must then finish within
    safety.collective_timeout_s."""
    if dist_info.is_main:
        model_dir = resolve_model_dir(cfg.model, cfg.data, cfg.trainer)
        print(f"rltrain: model {model_dir}", flush=True)
    barrier()
    if not dist_info.is_main:
        model_dir = resolve_model_dir(cfg.model, cfg.data, cfg.trainer)
    return model_dir


def run(cfg: Config, run_dir: Path) -> None:
    from rltrain.models.tokenizer import load_tokenizer, with_chat_template_kwargs

    if os.environ.get("RANK", "0") != "0" or cfg.model.path is None:  # a user's model: rank 0 shows its load
        quiet_transformers_checkpoint_bars()
    settle_owed_collection()  # the previous job's engine (a sweep's jobs share a process): rltrain.runtime.process_state
    dist_info = init_distributed(cfg.safety.collective_timeout_s)
    try:
        configure_threads(cfg, dist_info)
        if cfg.trainer.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        seed_everything(cfg.trainer.seed, dist_info.rank)
        model_dir = prepare_model_dir(cfg, dist_info)
        tokenizer = with_chat_template_kwargs(load_tokenizer(model_dir), cfg.data.chat_template_kwargs)
        role_dirs = resolve_role_dirs(cfg, model_dir, tokenizer, dist_info.rank)
        ctx = RunContext(
            cfg=cfg, run_dir=run_dir, dist=dist_info, model_dir=model_dir, tokenizer=tokenizer, role_dirs=role_dirs,
            faults=FaultInjector(parse_faults(cfg.debug.fault), dist_info.rank),
        )
        algo = build_algorithm(ctx)
        try:
            if cfg.eval.only:
                evaluate_only(ctx, algo)
            else:
                train_loop(ctx, algo)
        finally:
            algo.close()
    except UserError as exc:
        # Recorded before this rank leaves its collectives, so that the peers whose collectives
        # fail next find the cause and stay quiet (rltrain.runtime.errors).
        if dist_info.world_size > 1:
            report_user_error(run_dir, dist_info.rank, str(exc))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        reset_process_state()


def train_loop(ctx: RunContext, algo: Algorithm) -> None:
    cfg, dist_info, run_dir = ctx.cfg, ctx.dist, ctx.run_dir
    ckpt = CheckpointManager(
        run_dir, dist_info, cfg.trainer.keep_checkpoints, fingerprint(cfg, ctx.model_dir, dist_info.world_size)
    )
    start_step = 0
    latest = ckpt.latest() if cfg.trainer.resume == "auto" else None
    if latest is not None:
        state = ckpt.load(latest, algo.checkpoint_engines())
        algo.load_state_dict(state["algorithm"])
        start_step = int(state["step"])
        if dist_info.is_main:
            print(f"rltrain: resumed from {latest} (step {start_step})", flush=True)
    logger = MetricsLogger(cfg, run_dir, dist_info.is_main, start_step)
    # heartbeat, hang watchdog, health server, fault injection (docs/failure-behaviour.md)
    safety = SafetyServices(ctx, ping=algo.health_ping())
    safety.start()
    try:
        max_steps = cfg.trainer.max_steps
        if start_step == 0 and cfg.trainer.eval_every > 0:
            logger.log({"step": 0, **algo.evaluate(0)})
            logger.log_samples("samples/eval", 0, algo.samples())
            safety.progress()  # /healthz/deep judges ranks by progress (docs/failure-behaviour.md, "Health endpoints")
        for step in range(start_step + 1, max_steps + 1):
            safety.before_step(step)
            t0 = time.perf_counter()
            metrics = algo.train_step(step)
            elapsed = time.perf_counter() - t0
            row = {"step": step, **metrics, "time/step": elapsed}
            if "tokens" in metrics:
                row["tokens_per_s"] = metrics["tokens"] / max(elapsed, 1e-9)
            logger.log(row)
            logger.log_samples("samples/train", step, algo.samples())
            is_last = step == max_steps
            if is_last or (cfg.trainer.eval_every > 0 and step % cfg.trainer.eval_every == 0):
                evals = algo.evaluate(step)
                if evals:
                    logger.log({"step": step, **evals})
                logger.log_samples("samples/eval", step, algo.samples())
            # Saved after the step's rows are written: a checkpoint at step N implies rows 1..N.
            if is_last or (cfg.trainer.save_every > 0 and step % cfg.trainer.save_every == 0):
                ckpt.save(step, algo.checkpoint_engines(), {"algorithm": algo.state_dict()})
            safety.after_step(step)
        export_final(ctx, algo)
        if dist_info.is_main and cfg.logger.plot and (plot := write_run_plot(run_dir)) is not None:  # an error: a warning
            logger.log_image("plots", max_steps, plot)
    except Exception as exc:
        safety.explain_failure(exc)  # names the lost peer when a collective failed
        raise
    finally:
        safety.close()
        logger.close()
    if dist_info.is_main:
        print(f"rltrain: finished step {max_steps}; run directory {run_dir} (metrics.jsonl, final/, plots.png)",
              flush=True)


def export_final(ctx: RunContext, algo: Algorithm) -> None:
    """`final/`: config, safetensors and tokenizer, loadable by transformers and vLLM; with LoRA a
    PEFT adapter directory (docs/lora.md)."""
    final = ctx.run_dir / "final"
    tmp = ctx.run_dir / "final.tmp"
    if ctx.dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    algo.export_engine().save_pretrained(tmp)
    if ctx.dist.is_main:
        # A LoRA run's final/ is an adapter directory, its merged model (if asked for) in merged/.
        for directory in (tmp, tmp / MERGED_DIR):
            if not directory.is_dir():
                continue
            ctx.tokenizer.save_pretrained(str(directory))
            copy_processor_files(ctx.model_dir, directory)  # a vision-language model's processor
            for path in directory.iterdir():
                if path.is_file():
                    fsync_path(path)
            fsync_path(directory)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        fsync_path(ctx.run_dir)
    barrier()
