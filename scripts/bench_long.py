"""Memory per rank and tokens/s of one long sequence's forward+backward at backend.cp = 1, 2 (and 4).

    .venv/bin/python scripts/bench_long.py                                   # hidden 512, 8 layers, 1k-16k tokens
    .venv/bin/python scripts/bench_long.py --hidden 256 --layers 4 --cp 1,2 --max-gib 2

A Qwen2-shaped model with random weights is built locally; each cp runs in cp fresh processes
(gloo ranks, one FSDP engine with `backend.cp`, fp32, one SFT step per length: the whole sequence
is its completion, so every position is scored). Memory is measured on CPU as the OS sees it: each
rank resets its resident-set high-water mark (`/proc/self/clear_refs`) just before the step and
reads `VmHWM` after it (with glibc returning every freed block of 64 KiB or more to the OS, so the
resident set follows what tensors hold); the step's *activation* memory is that peak minus the resident memory before
the step (weights, gradients and AdamW state already allocated by a warm-up step on 64 tokens). The
longest sequence fitting `--max-gib` per rank (peak resident memory, everything included) is found
from a straight-line fit of the peak over the two longest lengths, then run to check it fits
(stepping down 10% until it does). docs/benchmarks.md has the numbers and docs/long-sequences.md
what they mean.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _status_gib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20  # kB
    raise RuntimeError(f"/proc/self/status has no {field} line")


def _sequence(length: int):
    import torch

    from rltrain.data.batch import SequenceBatch

    tokens = [4 + (j * 7) % 90 for j in range(length)]
    batch = SequenceBatch.from_lists([tokens[:1]], [tokens[1:]])
    batch.extras["global_tokens"] = torch.tensor(float(length - 1))
    return batch


def _measure(engine, length: int) -> dict:
    """One SFT step on one `length`-token sequence: (activation GiB, peak GiB, seconds) on this rank."""
    import ctypes

    import torch.distributed as dist

    from rltrain.algos.sft import sft_loss

    batch = _sequence(length)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _status_gib("VmRSS")
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    started = time.perf_counter()
    engine.train_step([batch], sft_loss)
    seconds = time.perf_counter() - started
    peak = _status_gib("VmHWM")
    return {"length": length, "activation_gib": peak - before, "peak_gib": peak, "seconds": seconds}


def _rank(rank: int, cp: int, port: int, model_dir: str, lengths: list[int], max_gib: float, cap: int, threads: int, out) -> None:
    import torch
    import torch.distributed as dist

    from rltrain.backends.fsdp.engine import FSDPEngine
    from rltrain.config.group_options import FSDPBackendConfig
    from rltrain.config.schema import OptimConfig

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    engine = FSDPEngine(Path(model_dir), FSDPBackendConfig(cp=cp), OptimConfig(lr=1e-5, warmup_steps=0), 100, torch.device("cpu"))
    _measure(engine, 64)  # gradients and optimizer state exist from here on
    rows = [_measure(engine, n) for n in lengths]
    longest = _longest(engine, rows, max_gib, cap)
    peaks = torch.tensor([[r["peak_gib"], r["activation_gib"]] for r in rows + [longest]], dtype=torch.float64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # the worst rank's
    for row, (peak, act) in zip(rows + [longest], peaks.tolist()):
        row["peak_gib"], row["activation_gib"] = peak, act
    if rank == 0:
        out.put(json.dumps({"cp": cp, "rows": rows, "longest": longest}))
    dist.destroy_process_group()


def _longest(engine, rows: list[dict], max_gib: float, cap: int) -> dict:
    """The longest length (at most `cap`) whose peak fits `max_gib` on every rank: a straight-line
    fit, then checked."""
    import torch
    import torch.distributed as dist

    (a, b) = rows[-2], rows[-1]
    slope = (b["peak_gib"] - a["peak_gib"]) / (b["length"] - a["length"])
    guess = torch.tensor([b["length"] + (max_gib - b["peak_gib"]) / max(slope, 1e-12)], dtype=torch.float64)
    dist.all_reduce(guess, op=dist.ReduceOp.MIN)
    length = max(256, min(cap, int(guess.item())) // 256 * 256)
    for _ in range(4):
        row = _measure(engine, length)
        peak = torch.tensor([row["peak_gib"]], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if peak.item() <= max_gib:
            return row
        length = max(256, int(length * 0.9) // 256 * 256)
    return row


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cp(cp: int, model_dir: Path, lengths: list[int], max_gib: float, cap: int, threads: int) -> dict:
    import torch

    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, cp, port, str(model_dir), lengths, max_gib, cap, threads, out)) for r in range(cp)]
    for p in procs:
        p.start()
    result = json.loads(out.get(timeout=24 * 3600))
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"cp={cp}: a rank exited with {p.exitcode}")
    return result


def build_model(args, directory: Path) -> Path:
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(
        hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
        intermediate_size=4 * args.hidden, max_position_embeddings=max(args.longest_cap, max(args.lengths_list)),
        cache_dir=str(directory),
    )
    return build_tiny_model_dir(cfg, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384", help="sequence lengths, ascending")
    parser.add_argument("--cp", default="1,2", help="context-parallel sizes to compare (4 needs 4 local ranks)")
    parser.add_argument("--max-gib", type=float, default=4.0, help="memory budget per rank for the longest sequence")
    parser.add_argument("--longest-cap", type=int, default=262144, help="the longest length the budget search tries")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    args.lengths_list = [int(n) for n in args.lengths.split(",") if n]
    cps = [int(c) for c in args.cp.split(",") if c]
    if len(args.lengths_list) < 2 or args.lengths_list != sorted(args.lengths_list):
        parser.error("--lengths needs at least two lengths, ascending")
    bad = [c for c in cps if c < 1 or args.heads % c]
    if bad:
        parser.error(f"--cp {bad}: each cp must be at least 1 and divide --heads={args.heads}")
    from bench_common import print_table

    # Every allocation of 64 KiB or more is its own mapping, returned to the OS when freed: without
    # this glibc raises its threshold as large blocks are freed and keeps freed blocks of up to 32 MiB
    # in its heap, so the resident set would count memory no tensor holds (more of it at cp=2,
    # whose tensors are half as large). The ranks inherit it; an explicit setting wins.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args, Path(tmp))
        results = {cp: run_cp(cp, model_dir, args.lengths_list, args.max_gib, args.longest_cap, args.threads) for cp in cps}
    base = results[cps[0]]
    rows = []
    for cp in cps:
        for row, ref in zip(results[cp]["rows"], base["rows"]):
            rows.append([
                str(cp), str(row["length"]), f"{row['activation_gib']:.3f}", f"{row['peak_gib']:.2f}",
                f"{row['activation_gib'] / ref['activation_gib']:.2f}" if cp != cps[0] else "",
                f"{row['length'] / row['seconds']:.0f}",
            ])
    print_table(
        f"one sequence's forward+backward, hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
        f"({args.kv_heads} kv), fp32, {args.threads} thread(s) per rank",
        ["cp", "tokens", "activation GiB/rank", "peak GiB/rank", f"activation vs cp={cps[0]}", "tokens/s"],
        rows,
        ["activation: the rank's peak resident memory during the step minus its resident memory before it (the worst rank);",
         "peak: everything the rank holds (interpreter, libraries, its shards, gradients, AdamW state); tokens/s: the sequence",
         "over the step's wall time, all cp ranks together"],
    )
    longest = [[str(cp), str(results[cp]["longest"]["length"]), f"{results[cp]['longest']['peak_gib']:.2f}",
                f"{results[cp]['longest']['length'] / base['longest']['length']:.2f}" if cp != cps[0] else ""] for cp in cps]
    print_table(
        f"longest sequence fitting --max-gib {args.max_gib} per rank", ["cp", "tokens", "peak GiB/rank", f"vs cp={cps[0]}"],
        longest, ["found by a straight-line fit of the peak over the two longest lengths, then run to check it fits"],
    )


if __name__ == "__main__":
    main()
