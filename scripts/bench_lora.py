"""Peak memory and step time of LoRA against full fine-tuning: SFT, DPO and GRPO's update.

    .venv/bin/python scripts/bench_lora.py                          # the 0.494B Qwen2 shape, CPU fp32
    .venv/bin/python scripts/bench_lora.py --model small --rank 16  # a ~10M-parameter model

The model is bench_gpu.py's, built locally with random weights (`--model qwen0.5b`: Qwen2.5-0.5B's
shape, scripts/gpu_rows.py), and so are the workloads (`Workload`, scripts/gpu_rltrain.py: the same
rows, losses and optimizer);
LoRA adapts every linear layer of the decoder (`model.lora.target_modules=[all-linear]`) with rank
`--rank`, and DPO's reference is the policy's base with the adapters off, as in a run. Both modes
recompute activations in the backward (`model.gradient_checkpointing=true`) unless
`--no-gradient-checkpointing`: what LoRA saves is weights' gradients and optimizer state, which a
long row's activations would otherwise hide (docs/lora.md shows both). Each of the
six (workload, mode) cells runs in a fresh process: `--warmup` untimed steps, then `--steps` timed
ones. Peak memory is that process's peak resident set during the steps (its high-water mark is reset
once the engine is built, so loading's transient copies do not count; on CUDA `max_memory_allocated`
too): it includes the interpreter, its libraries and the model's weights, the same for both modes. docs/lora.md has the numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODES = ("full", "lora")
WORKLOADS = ("sft", "dpo", "grpo")


def child(args) -> None:
    """One (workload, mode) cell in this process; prints its result as one JSON line."""
    from bench_common import cuda_peak_gib, init_single_rank, quiet_transformers
    from gpu_rltrain import Workload
    from gpu_rows import make_rows

    from rltrain.config.schema import LoraAdapterConfig

    quiet_transformers()
    torch.set_num_threads(args.threads or torch.get_num_threads())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    init_single_rank(args.port)
    adapters = LoraAdapterConfig(rank=args.rank, alpha=2 * args.rank) if args.mode == "lora" else None
    rows = make_rows((args.steps + args.warmup) * args.batch)
    workload = Workload(
        args.workload, Path(args.model_dir), rows, args, device, adapters=adapters,
        gradient_checkpointing=not args.no_gradient_checkpointing,
    )
    trainable = sum(p.numel() for p in workload.policy.scorer.parameters() if p.requires_grad)
    gc.collect()
    loaded_gib = _rss_gib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here: the steps' own
    times = [workload.step(k)[0] for k in range(args.steps + args.warmup)][args.warmup :]
    peak_rss_gib = _rss_gib("VmHWM")
    cuda_gib = cuda_peak_gib(device)
    print(json.dumps({"step_s": sum(times) / len(times), "peak_rss_gib": peak_rss_gib, "cuda_gib": cuda_gib,
                      "trainable": trainable, "loaded_gib": loaded_gib}))


def _rss_gib(field: str) -> float:
    """A memory line of /proc/self/status (VmRSS: now; VmHWM: the peak since the last reset), GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20  # kB
    raise RuntimeError(f"/proc/self/status has no {field} line")


def run_cell(args, model_dir: Path, workload: str, mode: str) -> dict:
    cmd = [
        sys.executable, __file__, "--child", "--workload", workload, "--mode", mode, "--model-dir", str(model_dir),
        "--rank", str(args.rank), "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
        "--micro", str(args.micro), "--group", str(args.group), "--threads", str(args.threads), "--port", str(args.port),
        *(["--no-gradient-checkpointing"] if args.no_gradient_checkpointing else []),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{workload}/{mode} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("qwen0.5b", "small"), default="qwen0.5b")
    parser.add_argument("--rank", type=int, default=16, help="model.lora.rank (alpha = 2 x rank)")
    parser.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated subset of sft,dpo,grpo")
    parser.add_argument("--steps", type=int, default=1, help="timed optimizer steps per cell")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=1, help="rows (pairs for DPO, sequences for GRPO) per step")
    parser.add_argument("--micro", type=int, default=1, help="rows per micro-batch")
    parser.add_argument("--group", type=int, default=2, help="GRPO: completions per prompt")
    parser.add_argument(
        "--no-gradient-checkpointing", action="store_true",
        help="keep every activation (model.gradient_checkpointing=false); they then dominate LoRA's memory",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--port", type=int, default=29553)
    # what a child cell reads (not for users)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.precision, args.padding_free, args.compile, args.max_tokens = "fp32", False, False, 0
    args.row_length, args.profile, args.no_share_prompts = 0, None, False  # bench_gpu.py's mixed rows, no profiling
    if args.child:
        child(args)
        return
    from bench_common import print_table
    from gpu_rows import build_model_dir

    names = [n for n in args.only.split(",") if n]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        model_dir = build_model_dir(args.model, Path(tmp) / "model", torch.device("cpu"))
        print(f"built the {args.model} model in {time.perf_counter() - started:.0f} s", flush=True)
        for name in names:
            cells = {mode: run_cell(args, model_dir, name, mode) for mode in MODES}
            full, lora = cells["full"], cells["lora"]
            for mode in MODES:
                c = cells[mode]
                rows.append([
                    name, mode, f"{c['trainable'] / 1e6:.2f}M", f"{c['step_s']:.2f}", f"{c['loaded_gib']:.2f}",
                    f"{c['peak_rss_gib']:.2f}",
                    "" if mode == "full" else f"{lora['peak_rss_gib'] / full['peak_rss_gib']:.2f}",
                    "" if mode == "full" else f"{lora['step_s'] / full['step_s']:.2f}",
                ])
    checkpointing = "no gradient checkpointing" if args.no_gradient_checkpointing else "gradient checkpointing"
    print_table(
        f"LoRA rank {args.rank} vs full fine-tuning, {args.model}, CPU fp32, batch {args.batch}, micro {args.micro}, "
        f"{checkpointing}",
        ["workload", "mode", "trainable", "step s", "loaded GiB", "step peak GiB", "memory ratio", "time ratio"],
        rows,
        ["loaded: the process's resident memory once the engine is built; step peak: its peak resident memory during",
         "the steps (optimizer state included), both of the whole process (interpreter and libraries too)"],
    )


if __name__ == "__main__":
    main()
