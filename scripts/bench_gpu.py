"""Training throughput on one device: SFT, DPO and GRPO's update, with tokens/s, MFU and peak memory.

    .venv/bin/python scripts/bench_gpu.py                       # CUDA: the 0.494B Qwen2 shape, bf16-mixed
    .venv/bin/python scripts/bench_gpu.py --model small         # any device: a small model (CPU: fp32)
    .venv/bin/python scripts/bench_gpu.py --only sft --steps 10 --warmup 3
    .venv/bin/python scripts/bench_gpu.py --compile             # decoder layers torch.compile'd (backend.compile)
    .venv/bin/python scripts/bench_gpu.py --padding-free --max-tokens 16384   # one packed row per ~16k tokens
    .venv/bin/python scripts/bench_gpu.py --only grpo --no-share-prompts      # GRPO's groups as plain rectangles
    .venv/bin/python scripts/bench_gpu.py --rows dense --batch 8 --micro 8 --backend fsdp,megatron --profile prof/
    PYTHONPATH=<trl dir> .venv/bin/python scripts/bench_gpu.py --model small --steps 2 --warmup 1 --batch 8 --micro 4 --threads 1

The model is built locally with random weights (no download; the model and the rows are built in
scripts/gpu_rows.py): `--model qwen0.5b` is Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query /
2 KV heads, intermediate 4864, vocabulary 151,936, tied embeddings), `--model small` a
~10M-parameter one. The tokenizer is the character tokenizer of the embedded default, and the data
synthetic rows of 50-400 prompt + 50-600 completion characters (~530 tokens on average), or with
`--rows dense` every sequence exactly `--length` tokens (default 2048, a quarter of them prompt;
`--rows dense --batch 8 --micro 8` is 8 x 2048 per step and per micro-batch), `--batch` rows per
optimizer step in micro-batches of `--micro`; with `--max-tokens N` rltrain's micro-batches are
filled in order up to N tokens instead (`trainer.max_tokens_per_micro_batch`; with `--padding-free`
each is one packed row), while TRL keeps `--micro` rows. The loss and the optimizer step are the
same either way (losses are normalised by the step's counts), only memory and speed change.

What each row times (one optimizer step, after `--warmup` untimed ones; rltrain's rows,
scripts/gpu_rltrain.py, on FSDP, or with `--backend fsdp,megatron` on both backends, megatron at
tp = pp = 1, labelled "(megatron)"):
- plain loop (`--only plain`, scripts/gpu_plain_loop.py): the ceiling reference, SFT's rows and
  micro-batches in a plain PyTorch loop over `AutoModelForCausalLM` (bf16 autocast over fp32 weights
  on CUDA), completion-only NLL, AdamW; once with the model's full logits + `cross_entropy`
  ("plain loop") and once with the output head + cross-entropy in checkpointed chunks of positions
  ("plain loop, chunked CE"). Each rltrain and TRL row's `vs plain` is its MFU over the MFU of the
  plain variant whose head rltrain's engine uses on these micro-batches (chunked past its logits
  budget: the 0.494B shape's vocabulary; full on the small model).
- SFT: completion-only NLL, forward + backward + AdamW on the policy engine.
- DPO: the online reference's forward, then the policy's forward + backward + AdamW over
  `--batch` pairs (chosen and rejected completions share a prompt).
- GRPO update: the training pass over fixed rollouts (prompts x `--group` sampled completions of
  random tokens, advantages given): forward + backward + AdamW, no generation.

MFU = model FLOPs per second / the matmul peak measured here on the same device and dtype (one large
matmul, best of several). A prompt shared by a DPO pair or a GRPO group counts once (tokens/s
counts it per sequence, as TRL does). Model FLOPs per trained token = 6 x (matmul parameters) + 6 x layers x
hidden x (mean sequence length) for causal attention (forward + backward, half the square); a
forward-only token (DPO's reference) counts a third of that. Peak memory is
`torch.cuda.max_memory_allocated` (CUDA only).

`--profile DIR` runs one more step per workload, after the timed ones (so the table is not slowed
by the profiler), under torch.profiler (CPU and CUDA activities), writes its trace to DIR and prints
a summary (scripts/gpu_profile.py): the top 8 ops or kernels by self device time (host time on CPU),
and the step's shares in communication, in `Optimizer.step`, and (CUDA) with the device idle.

With TRL importable (pinned with the test tools, requirements/; `--no-trl` skips it), TRL 1.16
(scripts/gpu_trl.py) runs each workload on the same model, rows, `--batch` and `--micro` (its
`per_device_train_batch_size` = `--micro`, gradient accumulation = `--batch / --micro`), the same
optimizer settings (AdamW, lr 1e-5 constant, clipping at 1.0), bf16 autocast over fp32 weights where
ours is `bf16-mixed` (fp32 on CPU), activations kept on both sides (TRL's configs default to
recomputing them: turned off), and its row is printed under ours with the same columns. Its step is
timed from its `on_step_begin` to its `on_step_end` callback (the step's micro-batches are already
loaded and collated; the forwards, backwards, clipping, AdamW step and zero_grad are inside),
CUDA-synchronised at both ends:
- SFT: `SFTTrainer(...).train()`, completion-only loss, no packing, rows in order.
- DPO: `DPOTrainer(...).train()` with an explicit `ref_model` scored online every step (no
  precomputed reference log-probabilities), sigmoid loss, beta 0.1 as ours, pairs in order, no
  truncation. TRL pads chosen and rejected each with its own copy of the prompt.
- GRPO update: `GRPOTrainer(...).train()` with generation and reward scoring bypassed: its
  `_generate_and_score_completions` is replaced by the part of it that follows scoring (prompts
  padded left, completions right, moved to the device, loss tokens counted), fed our prompts,
  completions and advantages. As in TRL's own code, the whole step is padded before it is split,
  so every micro-batch is as wide as the step's longest prompt plus its longest completion.
  Everything else is TRL's own step: `_prepare_inputs` (shuffle, split into micro-batches of
  `--micro` sequences), `compute_loss` (forward with its fused output head and entropies, clipped
  token-level `dapo` loss: clip 0.2 / 0.28, no KL, normalised by the step's completion tokens, as
  our `token_mean`), backward, clipping and AdamW. With one iteration per generation and beta 0,
  TRL computes no old or reference log-probabilities in the bypassed part, and ours none either
  (old log-probabilities and entropies come from the training pass), so neither side skips
  training work.

Tokens/s is counted the same way on both sides (every sequence's prompt + completion tokens; a
warning is printed if TRL tokenized different counts). TRL's MFU divides the same model FLOPs per
step as ours by TRL's step time, so the two MFUs differ exactly by the speed ratio. The sides run
one after the other, not interleaved: on a shared CPU the ratio is noisy (bench_sft.py and
bench_dpo.py interleave; this script is meant for an otherwise idle GPU).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from bench_common import (
    cuda_peak_gib,
    cuda_sync,
    init_single_rank,
    print_table,
    quiet_transformers,
    release_memory,
    trl_available,
)
from gpu_rltrain import Workload, count_matmul_params
from gpu_rows import (
    LR,
    SHAPES,
    build_model_dir,
    grpo_sequences,
    make_rows,
    micro_indices,
    sft_rows,
    total_steps,
)
from gpu_trl import TRL_NAMES, run_trl

WORKLOADS = ("plain", "sft", "dpo", "grpo")


def matmul_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Best FLOP/s of a square matmul on this device and dtype."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5 if device.type == "cuda" else 3):
        cuda_sync(device)
        t0 = time.perf_counter()
        for _ in range(10 if device.type == "cuda" else 1):
            a @ b
        cuda_sync(device)
        best = min(best, (time.perf_counter() - t0) / (10 if device.type == "cuda" else 1))
    return 2 * n**3 / best


def _timed_steps(step, args, label: str, device: torch.device) -> list:
    """Warm-up and timed steps' results, timed ones only; with --profile, then one step profiled."""
    from gpu_profile import StepProfiler

    results = [step(k) for k in range(args.warmup + args.steps)][args.warmup :]
    if args.profile:
        profiler = StepProfiler(args.profile, f"{args.rows} {label}", device)
        profiler.start()
        step(args.warmup + args.steps)
        profiler.stop()
    return results


def ours_label(name: str, backend_name: str) -> str:
    return f"rltrain {name}" + (f" ({backend_name})" if backend_name != "fsdp" else "")


def run_ours(
    name: str, model_dir: Path, rows, args, device: torch.device, backend_name: str = "fsdp", shared=None
) -> dict:
    """`shared`: the process's SharedObjects (rltrain.config.run_context): megatron's workloads join
    one parallel state, one after another."""
    workload = Workload(
        name, model_dir, rows, args, device, backend_name=backend_name, optim_implementation=args.optim, shared=shared
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timings = _timed_steps(workload.step, args, ours_label(name, backend_name), device)
    seconds = sum(t for t, _, _ in timings)
    out = {
        "tokens/s": sum(n for _, _, n in timings) / seconds,
        "flops/s": sum(f for _, f, _ in timings) / seconds,
        "step tokens": [n for _, _, n in timings],
        "peak GiB": cuda_peak_gib(device),
    }
    if backend_name == "megatron":  # megatron's shared parallel state keeps its engines' models for re-binding
        workload.policy.groups.detach(*[e.model for e in [workload.policy, workload.reference] if e is not None])
    del workload
    release_memory(device)
    return out


def run_plain(head: str, model_dir: Path, rows, args, precision, device: torch.device) -> dict:
    """The plain PyTorch loop (scripts/gpu_plain_loop.py) on SFT's rows and micro-batches; its model
    FLOPs per step counted as rltrain SFT's."""
    from gpu_plain_loop import HEADS, PlainLoop
    from transformers import AutoConfig

    from rltrain.models.tokenizer import load_tokenizer

    tok, config = load_tokenizer(model_dir), AutoConfig.from_pretrained(model_dir)
    steps = []
    for k in range(total_steps(args)):
        prompts, completions = sft_rows(tok, rows, k, args.batch)
        steps.append([[(prompts[i], completions[i]) for i in idx] for idx in micro_indices(prompts, completions, args)])
    loop = PlainLoop(model_dir, steps, head, device, precision.mixed, tok.pad_token_id, LR)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = _timed_steps(loop.step, args, HEADS[head], device)
    flops, tokens = [], []
    for step in steps[args.warmup : args.warmup + args.steps]:
        seqs = [len(p) + len(c) for micro in step for p, c in micro]
        mean_len = sum(n * n for n in seqs) / sum(seqs)
        flops.append(sum(seqs) * (6 * count_matmul_params(config) + 6 * config.num_hidden_layers * config.hidden_size * mean_len))
        tokens.append(sum(seqs))
    out = {"tokens/s": sum(tokens) / sum(seconds), "flops/s": sum(flops) / sum(seconds), "step tokens": tokens,
           "peak GiB": cuda_peak_gib(device)}
    del loop
    release_memory(device)
    return out


def check_batches(parser: argparse.ArgumentParser, args, names: list[str], with_trl: bool) -> None:
    """Bad workload names or batch shapes TRL cannot take stop here, before any model is built."""
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"--only {args.only}: unknown workload(s) {', '.join(unknown)}; choose from {','.join(WORKLOADS)}")
    bad_backends = sorted(set(args.backend.split(",")) - {"fsdp", "megatron"})
    if bad_backends:
        parser.error(f"--backend {args.backend}: unknown backend(s) {', '.join(bad_backends)}; choose from fsdp,megatron")
    if "megatron" in args.backend.split(",") and (args.padding_free or args.compile or args.no_share_prompts):
        parser.error("--padding-free, --compile and --no-share-prompts are FSDP options (backend.padding_free, "
                     "backend.compile, backend.share_prompts); pass --backend fsdp with them")
    if args.profile is not None and args.profile.exists() and not args.profile.is_dir():
        parser.error(f"--profile {args.profile}: a file is there; name a folder (created if missing) for the traces")
    if args.rows == "dense" and args.length < 8:
        parser.error(f"--length {args.length}: dense rows need at least 8 tokens (a quarter prompt, the rest completion)")
    if not with_trl:
        return
    if args.batch % args.micro:
        parser.error(f"--batch {args.batch} is not a multiple of --micro {args.micro}: TRL accumulates whole "
                     "micro-batches (gradient accumulation = batch / micro); change one of them, or pass --no-trl")
    if "grpo" in names and (args.group < 2 or grpo_sequences(args.batch, args.group) % args.micro):
        parser.error(f"GRPO with TRL needs --group >= 2 and its {grpo_sequences(args.batch, args.group)} sequences per "
                     f"step (batch // group prompts x group) to be a multiple of --micro {args.micro}; change "
                     "--batch, --group or --micro, or pass --no-trl")


def _row(name: str, result: dict, peak: float, plain: dict | None, vs_trl: str) -> list[str]:
    """A table row; `vs plain` is the MFU ratio to `plain` (the plain loop with rltrain's head)."""
    mem = f"{result['peak GiB']:.1f}" if result["peak GiB"] is not None else "-"
    vs_plain = f"{result['flops/s'] / plain['flops/s']:.2f}x" if plain else "-"
    return [name, f"{result['tokens/s']:.0f}", f"{100 * result['flops/s'] / peak:.1f}%", mem, vs_plain, vs_trl]


def rltrain_head(model_dir: Path, rows, args) -> str:
    """The head rltrain's FSDP engine uses on these micro-batches (chunked past its logits budget),
    so rltrain is compared with the plain loop that has the same head."""
    from gpu_plain_loop import HEADS
    from transformers import AutoConfig

    from rltrain.backends.chunked_head import exceeds_chunk_limit
    from rltrain.models.tokenizer import load_tokenizer

    tok, vocab = load_tokenizer(model_dir), AutoConfig.from_pretrained(model_dir).vocab_size
    prompts, completions = sft_rows(tok, rows, 0, args.batch)
    widest = max(sum(len(prompts[i]) + len(completions[i]) for i in idx) for idx in micro_indices(prompts, completions, args))
    return HEADS["chunked" if exceeds_chunk_limit(widest, vocab) else "full"]


def _leading_notes(peak: float, precision, with_trl: bool, same_head: str | None) -> list[str]:
    """What the table's columns measure against: the matmul peak, TRL, the plain loop (when it ran)."""
    notes = [
        f"matmul peak measured here: {peak / 1e12:.1f} TFLOP/s ({precision.compute_dtype_name})",
        "TRL 1.16: same rows, batch and micro-batch, run after ours (not interleaved); vs TRL = tokens/s ratio"
        if with_trl else "TRL: not importable or --no-trl",
    ]
    if same_head is not None:
        notes.append(f"vs plain = MFU / the MFU of the '{same_head}' row (the plain loop with rltrain's output head); "
                     "for sft (the same rows and micro-batches) also the tokens/s ratio")
    return notes


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default=None, help="default: qwen0.5b on CUDA, small on CPU")
    parser.add_argument("--precision", default="auto", help="trainer.precision (auto: bf16-mixed on CUDA, fp32 on CPU)")
    parser.add_argument("--only", default="plain,sft,dpo,grpo", help="comma-separated subset of plain,sft,dpo,grpo "
                        "(plain: the plain PyTorch loop, full logits and chunked CE)")
    parser.add_argument("--rows", choices=("mixed", "dense"), default="mixed",
                        help="mixed: 50-400 prompt + 50-600 completion tokens; dense: every sequence --length tokens")
    parser.add_argument("--length", type=int, default=2048, help="--rows dense: tokens per sequence (a quarter prompt)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="one more step per workload under torch.profiler: a trace in this folder, a summary printed")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per workload")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=32, help="rows (pairs for DPO, sequences for GRPO) per step")
    parser.add_argument("--micro", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--group", type=int, default=8, help="GRPO: completions per prompt")
    parser.add_argument("--no-trl", action="store_true", help="skip TRL even when importable")
    parser.add_argument("--padding-free", action="store_true", help="rltrain's rows with backend.padding_free=true")
    parser.add_argument(
        "--max-tokens", type=int, default=0,
        help="rltrain's micro-batches by token budget (trainer.max_tokens_per_micro_batch=N, rows in order, any "
        "number of them); TRL keeps --micro rows. 0: --micro rows on both sides",
    )
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch intra-op threads, the same for both sides (default: torch's own; on a shared CPU use 1, "
        "as bench_sft.py and bench_dpo.py do)",
    )
    parser.add_argument("--port", type=int, default=29541)
    parser.add_argument("--backend", default="fsdp",
                        help="rltrain's backend(s) for its rows, comma-separated: fsdp, megatron (tp = pp = 1) or both")
    parser.add_argument("--compile", action="store_true", help="backend.compile=true: torch.compile each decoder layer")
    parser.add_argument("--no-share-prompts", action="store_true",
                        help="backend.share_prompts=false: a GRPO group's or DPO pair's prompt computed once per sequence "
                        "(plain rectangles with causal attention) instead of once per packed row (a dense mask)")
    parser.add_argument("--optim", choices=("auto", "for-loop", "foreach", "fused"), default="auto",
                        help="rltrain's optim.implementation: AdamW's kernels (auto: the backend's own)")
    return parser


def main() -> None:
    parser = make_parser()
    args = parser.parse_args()
    args.row_length = args.length if args.rows == "dense" else 0
    from rltrain.config.run_context import SharedObjects
    from rltrain.runtime.precision import resolve_precision

    names, backends = args.only.split(","), args.backend.split(",")
    with_trl = not args.no_trl and trl_available()
    check_batches(parser, args, names, with_trl)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = args.model or ("qwen0.5b" if device.type == "cuda" else "small")
    precision = resolve_precision(args.precision, device)
    quiet_transformers()
    init_single_rank(args.port)
    peak = matmul_peak_flops(device, precision.compute_dtype)
    table: list[list[str]] = []
    notes: list[str] = []

    def add(cells: list[str]) -> None:
        """A measured row, printed at once too: a run cut short (a device call's limit) keeps it."""
        table.append(cells)
        print("row: " + " | ".join(cells), flush=True)

    shared = SharedObjects()  # megatron's parallel state, one per process, shared by its workloads
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(shape, Path(tmp) / "model", device, max(2048, args.row_length))
        rows = make_rows(total_steps(args) * args.batch, length=args.row_length)
        plain, same_head = {}, rltrain_head(model_dir, rows, args)
        if "plain" in names:
            from gpu_plain_loop import HEADS

            for head, label in HEADS.items():
                plain[label] = run_plain(head, model_dir, rows, args, precision, device)
                add(_row(label, plain[label], peak, None, "-"))
        for name in [n for n in names if n != "plain"]:
            results = {b: run_ours(name, model_dir, rows, args, device, b, shared) for b in backends}
            theirs = run_trl(name, model_dir, rows, args, precision, device, Path(tmp) / "trl") if with_trl else None
            for backend_name, result in results.items():
                vs_trl = f"{result['tokens/s'] / theirs['tokens/s']:.2f}x" if theirs else "-"
                add(_row(ours_label(name, backend_name), result, peak, plain.get(same_head), vs_trl))
            if theirs is None:
                continue
            ours = results[backends[0]]
            theirs["flops/s"] = ours["flops/s"] / ours["tokens/s"] * theirs["tokens/s"]  # the same work per token
            add(_row(f"TRL 1.16 {TRL_NAMES[name]}", theirs, peak, plain.get(same_head), "1.00x"))
            if theirs["step tokens"] != ours["step tokens"]:
                notes.append(f"warning: {name}: TRL tokenized {theirs['step tokens']} tokens per step, rltrain {ours['step tokens']}")
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    notes[:0] = _leading_notes(peak, precision, with_trl, same_head if plain else None)
    title = _title(args, shape, device_name, precision.name)
    print_table(title, ["workload", "tokens/s", "MFU", "peak GiB", "vs plain", "vs TRL"], table, notes)


def _title(args: argparse.Namespace, shape: str, device_name: str, precision_name: str) -> str:
    rows_text = f"dense rows of {args.length} tokens" if args.row_length else "mixed-length rows"
    return (
        f"{shape} ({device_name}, {precision_name}, rltrain on {args.backend}{', padding-free' if args.padding_free else ''}"
        f"{', torch.compile per layer' if args.compile else ''}{', prompts not shared' if args.no_share_prompts else ''}"
        f"{f', AdamW {args.optim}' if args.optim != 'auto' else ''}), "
        f"{args.batch} {rows_text}/step in micro-batches of "
        f"{f'<= {args.max_tokens} tokens (TRL: {args.micro} rows)' if args.max_tokens else args.micro}, "
        f"{args.steps} timed steps (+{args.warmup} warm-up), {torch.get_num_threads()} CPU threads"
    )


if __name__ == "__main__":
    main()
