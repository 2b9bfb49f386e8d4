"""GRPO on the tiny Mixture of Experts: step time, tokens/s and peak memory per rank, FSDP2 and
megatron with expert parallelism (ep=1 and ep=2 on 2 ranks), TRL's GRPOTrainer beside them.

The model is `model=tiny_moe` (rltrain/models/tiny_moe.py: 4 sparse layers, 8 experts of width 128,
top-2, hidden 128, seed 0), the model every MoE test runs: a bench-sized MoE would take minutes per
step on 2 shared cores, and the question here is what the backends' MoE paths (FSDP2: every expert
on every rank; megatron: all-to-all dispatch over gloo) cost around the same experts, not a compute
ceiling (bench_gpu.py measures that for dense models).
docs/benchmarks.md, "Mixture of Experts", has the table and what each row runs.

Every rltrain row is one CLI run (`python -m rltrain algo=grpo model.path=<the tiny MoE> ...`, vLLM's
CPU build in process, weights synced to it every step) with the same GRPO step as bench_grpo.py
(16 prompts x 8 completions, temperature 1, clipped token-level loss, no KL, lr 2e-3, fp32); the
table reads its `metrics.jsonl`: `time/step`, `time/rollout`, `time/train`, `tokens_per_s` (prompt
+ completion tokens trained, over every rank, per second of the step) and `rollout/tokens_per_s`.
Peak memory is each rank process's peak resident set (`VmHWM`, polled from /proc while the run
lives; a rank is a process of the run's tree started with `RANK` in its environment): it includes the in-process vLLM engine (its KV cache held at `rollout.kv_cache_gib`) and
the Python runtime, not only the model, so compare rows with each other, not with a parameter
count. TRL's GRPOTrainer runs in this process on the same prompts (transformers generate: its
colocated vLLM path fails on vLLM's CPU build) with activations kept; its peak is this process's.

    .venv/bin/python scripts/bench_moe.py [--rows fsdp,fsdp2,ep1,ep2] [--steps 4] [--warmup 1] [--max-new-tokens 16] [--no-trl]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
from bench_common import (
    THREADS_HELP,
    GRPOShape,
    GRPOStepRow,
    grpo_prompt_stream,
    print_table,
    quiet_transformers,
    trl_available,
    trl_grpo_steps,
)

REPO = Path(__file__).resolve().parents[1]
SHAPE = GRPOShape()  # bench_grpo.py's step: 16 prompts x 8, lr 2e-3, clip 0.2 / 0.28
KV_CACHE_GIB = 0.25  # each rank's vLLM KV cache: part of every rltrain row's peak memory
# The rltrain rows: (label, ranks, the CLI's backend keys).
ROWS = {
    "fsdp": ("FSDP2, 1 rank", 1, ["backend=fsdp"]),
    "fsdp2": ("FSDP2, 2 ranks", 2, ["backend=fsdp"]),
    "ep1": ("megatron ep=1, 2 ranks", 2, ["backend=megatron", "backend.ep=1"]),
    "ep2": ("megatron ep=2, 2 ranks", 2, ["backend=megatron", "backend.ep=2"]),
}
POLL_S = 0.2


def tiny_moe_dir(cache: Path) -> Path:
    """`model=tiny_moe` as the CLI composes it, built once into `cache`."""
    from hydra import compose, initialize_config_dir

    from rltrain.__main__ import CONF_DIR
    from rltrain.config.schema import register_configs
    from rltrain.models.tiny_moe import build_tiny_moe_model_dir

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["model=tiny_moe", f"model.cache_dir={cache}"])
    return build_tiny_moe_model_dir(cfg.model, seed=0)


def peak_rss_gib(pid: int) -> float | None:
    """A live process's peak resident set (VmHWM) in GiB; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def rank_pids(root: int, ranks: int) -> list[int]:
    """The run's rank processes: the CLI itself for one rank, else the launcher's workers: the
    top-most processes of its tree whose environment has `RANK` (their own children inherit it)."""
    import psutil

    if ranks == 1:
        return [root]
    try:
        tree = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    ranked = set()
    for proc in tree:
        try:
            if "RANK" in proc.environ():
                ranked.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    pids = []
    for proc in tree:
        try:
            if proc.pid in ranked and proc.ppid() not in ranked:
                pids.append(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return pids


def run_rltrain(model_dir: Path, run_dir: Path, ranks: int, backend: list[str], total: int, max_new: int,
                threads: int) -> tuple[list[GRPOStepRow], list[float]]:
    """One CLI run: its per-step metric rows and each rank's peak resident set (GiB), polled while it runs."""
    cmd = [
        sys.executable, "-m", "rltrain", "algo=grpo", f"model.path={model_dir}", *backend, f"trainer.nproc={ranks}",
        f"hydra.run.dir={run_dir}", f"trainer.max_steps={total}", "trainer.eval_every=0", "trainer.save_every=0",
        "trainer.progress=lines", "logger.wandb.mode=disabled", f"trainer.num_threads={threads}",
        f"data.num_eval={SHAPE.num_eval}", "trainer.seed=0", "rollout.seed=0", f"rollout.kv_cache_gib={KV_CACHE_GIB}",
        f"algo.prompts_per_step={SHAPE.prompts}", f"algo.group_size={SHAPE.group}", f"algo.max_new_tokens={max_new}",
        "algo.temperature=1.0", "algo.top_p=1.0", "algo.beta=0.0", f"algo.clip_low={SHAPE.clip_low}",
        f"algo.clip_high={SHAPE.clip_high}", "algo.loss_agg=token_mean", "algo.scale_rewards=group",
        f"optim.lr={SHAPE.lr}", "optim.schedule=constant", "optim.warmup_steps=0", "optim.max_grad_norm=1.0",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, float] = {}
    done = threading.Event()

    def poll() -> None:
        while not done.wait(POLL_S):
            for pid in rank_pids(proc.pid, ranks):
                peak = peak_rss_gib(pid)
                if peak is not None:
                    peaks[pid] = max(peaks.get(pid, 0.0), peak)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    _, stderr = proc.communicate()
    done.set()
    poller.join()
    if proc.returncode != 0:
        sys.exit(f"rltrain CLI failed ({proc.returncode}):\n{stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # the ranks: the largest (a launcher's helper process can carry RANK too, at a few MiB)
    return [r for r in rows if "time/step" in r], sorted(peaks.values(), reverse=True)[:ranks]


def with_prompt_tokens(steps: list[GRPOStepRow], rows: list[dict[str, str]], model_dir: Path) -> list[GRPOStepRow]:
    """TRL's steps with `tokens`: each step's prompts (taken in order, each `SHAPE.group` times) as
    its tokenizer encodes them, plus the completions it generated, as rltrain counts `tokens`."""
    from rltrain.models.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    out = []
    for k, step in enumerate(steps):
        prompts = rows[k * SHAPE.prompts : (k + 1) * SHAPE.prompts]
        prompt_tokens = SHAPE.group * sum(len(tok(r["prompt"])["input_ids"]) for r in prompts)
        out.append({**step, "tokens": float(prompt_tokens + step["rollout_tokens"])})
    return out


def med(rows: list[GRPOStepRow], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def table_rows(ours: dict[str, tuple[list[GRPOStepRow], list[float]]], theirs: list[GRPOStepRow],
               trl_peak_gib: float) -> list[list[str]]:
    """The printed rows: each rltrain row's medians and rank peaks, TRL's last; the last column is
    the step time over TRL's (or over the first row's without TRL)."""
    base = med(theirs, "time/step") if theirs else med(next(iter(ours.values()))[0], "time/step")
    out = []
    for label, (steps, peaks) in ours.items():
        out.append([
            label, f"{med(steps, 'time/step'):.3f}", f"{med(steps, 'time/rollout'):.3f}", f"{med(steps, 'time/train'):.3f}",
            f"{med(steps, 'tokens_per_s'):.0f}", f"{med(steps, 'rollout/tokens_per_s'):.0f}",
            " / ".join(f"{p:.2f}" for p in peaks) or "-", f"{med(steps, 'time/step') / base:.2f}",
        ])
    if theirs:
        tokens_per_s = statistics.median(r["tokens"] / r["time/step"] for r in theirs)
        out.append([
            "TRL GRPOTrainer (use_vllm=False)", f"{med(theirs, 'time/step'):.3f}", f"{med(theirs, 'time/rollout'):.3f}",
            f"{statistics.median(r['time/step'] - r['time/rollout'] for r in theirs):.3f}", f"{tokens_per_s:.0f}",
            f"{statistics.median(r['rollout_tokens'] / r['time/rollout'] for r in theirs):.0f}", f"{trl_peak_gib:.2f}",
            "1.00",
        ])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"rltrain rows, comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (vLLM and allocator warm-up)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--no-trl", action="store_true", help="leave TRL's row out")
    parser.add_argument("--threads", type=int, default=1, help=THREADS_HELP + "; per rank")
    args = parser.parse_args()
    chosen = [r for r in args.rows.split(",") if r]
    unknown = [r for r in chosen if r not in ROWS]
    if unknown or not chosen:
        parser.error(f"--rows: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(ROWS)}")
    torch.set_num_threads(args.threads)
    quiet_transformers()
    total = args.steps + args.warmup
    with_trl = not args.no_trl and trl_available()
    if not args.no_trl and not with_trl:
        print("TRL is not importable: install trl==1.16.0 to compare")
    ours: dict[str, tuple[list[GRPOStepRow], list[float]]] = {}
    theirs: list[GRPOStepRow] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_moe_dir(Path(tmp) / "cache")
        n_params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(model_dir).parameters())
        for name in chosen:
            label, ranks, backend = ROWS[name]
            steps, peaks = run_rltrain(model_dir, Path(tmp) / name, ranks, backend, total, args.max_new_tokens, args.threads)
            ours[label] = (steps[args.warmup :], peaks)
        if with_trl:
            rows = grpo_prompt_stream(model_dir, total, SHAPE)
            theirs = with_prompt_tokens(trl_grpo_steps(model_dir, rows, total, args.max_new_tokens, Path(tmp) / "trl", SHAPE),
                                        rows, model_dir)[args.warmup :]
    trl_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    notes = [
        "tok/s: prompt + completion tokens trained per second of the whole step (rollout, sync and training), "
        "over every rank; rollout tok/s: completion tokens per second of generation.",
        f"peak GiB: each rank process's peak resident set, the in-process vLLM engine ({KV_CACHE_GIB} GiB KV cache) "
        "included; TRL's: this process's.",
        "CPU shared with other jobs: timings are noisy; medians over the timed steps.",
    ]
    print_table(
        f"GRPO, tiny MoE ({n_params / 1e6:.2f}M params, 8 experts top-2), addition task, {SHAPE.prompts} prompts x "
        f"{SHAPE.group} completions, max {args.max_new_tokens} new tokens, {args.steps} timed steps (+{args.warmup} "
        f"warm-up), {args.threads} thread(s) per rank, CPU fp32",
        ["system", "step s", "rollout s", "train s", "tok/s", "rollout tok/s", "peak GiB per rank",
         "step vs TRL" if theirs else "step vs first"],
        table_rows(ours, theirs, trl_peak), notes,
    )


if __name__ == "__main__":
    main()
