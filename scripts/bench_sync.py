"""Benchmark weight sync: out-of-process bucketed transport vs an in-process copy.

    .venv/bin/python scripts/bench_sync.py                        # ~4 minutes on 2 CPU cores
    .venv/bin/python scripts/bench_sync.py --params 1e6,1e8 --buckets-mb 4,64 --repeats 5

For each model size (fp32 parameters laid out like a small Qwen2: embedding, per-layer attention
and MLP matrices, norms, untied head) and bucket size it times:

* in-process: `dest[name].copy_(tensor)` into preallocated tensors, the floor any sync pays;
* out-of-process: `WeightSender.send()` to a `WeightReceiver` in a spawned child that copies
  every tensor into its own preallocated tensors, once with zero-copy views (`copy=False`, one
  copy per side) and once with owned tensors (`copy=True`, what vLLM's in-place reload needs:
  one extra copy on the receiver). The time is the sender's, which ends when the receiver has
  confirmed the last bucket, so it includes the receiver's work.

Both processes run single-threaded torch, so the numbers compare memory traffic, not thread
counts. The child is driven over a pipe with JSON commands (no pickle, as in the trainer).

Then (`--grpo-steps`, 0 to skip) it measures what the sync costs in a real GRPO step: it runs
`python -m rltrain algo=grpo` for a few steps with the vLLM engine in-process
(`rollout.process=colocated`) and in a child process (`separate`), and reports the median
`time/sync` against the median `time/step` (the first step, which includes warm-up, is left out).
Two models (`--grpo-models`): `bench`, the ~10M-parameter model every benchmark uses (bench_sft.py)
with bench_grpo.py's 32 new tokens, and `tiny`, the 0.8M embedded default with its own settings,
where vLLM's fixed per-reload bookkeeping (~15-20 ms whatever the size) is measured against a
step of a few tenths of a second. Target: weight sync under 5% of a GRPO step.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from rltrain.transport.receiver import WeightReceiver
from rltrain.transport.sender import WeightSender

Weights = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only transformer; `layers` is chosen to reach a parameter target."""

    vocab: int
    hidden: int
    intermediate: int
    kv_hidden: int  # grouped-query attention: k/v project to fewer channels than q
    layers: int

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        yield "model.embed_tokens.weight", (self.vocab, self.hidden)
        for layer in range(self.layers):
            prefix = f"model.layers.{layer}"
            yield f"{prefix}.input_layernorm.weight", (self.hidden,)
            yield f"{prefix}.self_attn.q_proj.weight", (self.hidden, self.hidden)
            yield f"{prefix}.self_attn.q_proj.bias", (self.hidden,)
            yield f"{prefix}.self_attn.k_proj.weight", (self.kv_hidden, self.hidden)
            yield f"{prefix}.self_attn.k_proj.bias", (self.kv_hidden,)
            yield f"{prefix}.self_attn.v_proj.weight", (self.kv_hidden, self.hidden)
            yield f"{prefix}.self_attn.v_proj.bias", (self.kv_hidden,)
            yield f"{prefix}.self_attn.o_proj.weight", (self.hidden, self.hidden)
            yield f"{prefix}.post_attention_layernorm.weight", (self.hidden,)
            yield f"{prefix}.mlp.gate_proj.weight", (self.intermediate, self.hidden)
            yield f"{prefix}.mlp.up_proj.weight", (self.intermediate, self.hidden)
            yield f"{prefix}.mlp.down_proj.weight", (self.hidden, self.intermediate)
        yield "model.norm.weight", (self.hidden,)
        yield "lm_head.weight", (self.vocab, self.hidden)

    def num_params(self) -> int:
        return sum(math.prod(shape) for _, shape in self.tensors())


def shape_for(target_params: int) -> ModelShape:
    """A plausible shape whose parameter count is close to `target_params`: the hidden size grows
    until ~8 layers would overshoot, the vocabulary is a modest share, layers fill the rest."""
    hidden = 128
    while hidden < 2048 and 12 * hidden * hidden * 8 < target_params:
        hidden *= 2
    vocab = min(32768, max(1024, target_params // (hidden * 16)))
    intermediate, kv_hidden = int(hidden * 2.75) // 16 * 16, hidden // 4
    without_layers = ModelShape(vocab, hidden, intermediate, kv_hidden, layers=0).num_params()
    per_layer = ModelShape(vocab, hidden, intermediate, kv_hidden, layers=1).num_params() - without_layers
    layers = max(1, round((target_params - without_layers) / per_layer))
    return ModelShape(vocab, hidden, intermediate, kv_hidden, layers)


def build_weights(shape: ModelShape) -> Weights:
    generator = torch.Generator().manual_seed(0)
    return [(name, torch.randn(size, generator=generator)) for name, size in shape.tensors()]


def nbytes_of(weights: Weights) -> int:
    return sum(tensor.numel() * tensor.element_size() for _, tensor in weights)


# ----------------------------------------------------------------------------- receiver process


def receiver_main(conn: Connection) -> None:
    """Child: for each JSON command, receive `syncs` syncs and load them into preallocated tensors."""
    torch.set_num_threads(1)
    destinations: dict[str, torch.Tensor] = {}
    while True:
        command = json.loads(conn.recv_bytes())
        if command["op"] == "stop":
            return
        try:
            receiver = WeightReceiver(command["control_path"], timeout_s=command["timeout_s"])
            for _ in range(command["syncs"]):
                for name, tensor in receiver.receive(copy=command["copy"]):
                    destination = destinations.get(name)
                    if destination is None or destination.shape != tensor.shape:
                        destination = destinations[name] = torch.empty_like(tensor)
                    destination.copy_(tensor)
            conn.send_bytes(json.dumps({"ok": True}).encode())
        except Exception:  # noqa: BLE001 - reported to the parent, which stops the benchmark
            conn.send_bytes(json.dumps({"ok": False, "error": traceback.format_exc()}).encode())


# ----------------------------------------------------------------------------- timing


def time_in_process(weights: Weights, repeats: int) -> float:
    destinations = {name: torch.empty_like(tensor) for name, tensor in weights}
    seconds = []
    for _ in range(repeats + 1):  # the first pass faults the destination pages in
        started = time.perf_counter()
        for name, tensor in weights:
            destinations[name].copy_(tensor)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:])


def time_out_of_process(
    conn: Connection, weights: Weights, bucket_bytes: int, copy: bool, repeats: int, timeout_s: float
) -> float:
    with WeightSender(bucket_bytes=bucket_bytes, timeout_s=timeout_s) as sender:
        command = {
            "op": "receive",
            "control_path": str(sender.control_path),
            "syncs": repeats + 1,
            "copy": copy,
            "timeout_s": timeout_s,
        }
        conn.send_bytes(json.dumps(command).encode())
        seconds = []
        for _ in range(repeats + 1):  # the first sync allocates the receiver's destinations
            seconds.append(sender.send(weights).seconds)
        if not conn.poll(timeout_s):
            raise TimeoutError("the receiver process did not report back")
        reply = json.loads(conn.recv_bytes())
        if not reply["ok"]:
            raise RuntimeError(f"receiver process failed:\n{reply['error']}")
    return statistics.median(seconds[1:])


def grpo_sync_fraction(steps: int, extra: list[str]) -> list[dict[str, float | str]]:
    """Run a short GRPO for each engine placement; median step and sync times (steps 2..N)."""
    import os
    import subprocess
    import sys

    results = []
    for process in ("colocated", "separate"):
        with tempfile.TemporaryDirectory(prefix="bench-grpo-") as run_dir:
            command = [
                sys.executable, "-m", "rltrain", "algo=grpo", f"trainer.max_steps={steps}",
                f"rollout.process={process}", "logger.wandb.mode=disabled", "trainer.eval_every=0",
                "trainer.save_every=0", "trainer.progress=lines", "data.num_eval=4", f"hydra.run.dir={run_dir}",
                *extra,
            ]  # fmt: skip
            subprocess.run(command, check=True, capture_output=True, env=dict(os.environ))
            rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
            rows = [r for r in rows if "loss" in r and r["step"] > 1]
            step_s = statistics.median(r["time/step"] for r in rows)
            sync_s = statistics.median(r["time/sync"] for r in rows)
            results.append({"process": process, "step_s": step_s, "sync_s": sync_s, "fraction": sync_s / step_s})
    return results


def grpo_model_overrides(model: str, cache: Path) -> list[str]:
    """CLI overrides for `--grpo-models`: the benchmark model (built into `cache`) or the default."""
    if model == "tiny":
        return []
    from bench_common import bench_model_dir

    return [f"model.path={bench_model_dir(cache)}", "algo.max_new_tokens=32"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="1e6,1e7,5e7", help="comma-separated fp32 parameter counts")
    parser.add_argument("--buckets-mb", default="1,16,64", help="comma-separated bucket sizes in MiB")
    parser.add_argument("--repeats", type=int, default=5, help="timed syncs per cell (median reported)")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--grpo-steps", type=int, default=5, help="GRPO steps per placement (0: skip)")
    parser.add_argument("--grpo-args", default="", help="extra space-separated overrides for the GRPO runs")
    parser.add_argument("--grpo-models", default="bench,tiny", help="comma-separated: bench (~10M), tiny (0.8M default)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    targets = [int(float(value)) for value in args.params.split(",")]
    buckets_mb = [int(value) for value in args.buckets_mb.split(",")]

    context = multiprocessing.get_context("spawn")
    parent_conn, child_conn = context.Pipe()
    child = context.Process(target=receiver_main, args=(child_conn,), daemon=True)
    child.start()
    header = (
        f"{'params':>10} {'tensors':>7} {'MB':>7} {'bucket':>7} | {'in-proc ms':>10} {'MB/s':>7} | "
        f"{'oop views ms':>12} {'MB/s':>7} | {'oop owned ms':>12} {'MB/s':>7}"
    )
    print(header)
    print("-" * len(header))
    started = time.perf_counter()
    try:
        for target in targets:
            weights = build_weights(shape_for(target))
            params = sum(tensor.numel() for _, tensor in weights)
            megabytes = nbytes_of(weights) / 1e6
            in_process_s = time_in_process(weights, args.repeats)
            for bucket_mb in buckets_mb:
                views_s, owned_s = (
                    time_out_of_process(
                        parent_conn, weights, bucket_mb << 20, copy, args.repeats, args.timeout_s
                    )
                    for copy in (False, True)
                )
                print(
                    f"{params / 1e6:>9.1f}M {len(weights):>7} {megabytes:>7.1f} {bucket_mb:>5}MB | "
                    f"{in_process_s * 1e3:>10.1f} {megabytes / in_process_s:>7.0f} | "
                    f"{views_s * 1e3:>12.1f} {megabytes / views_s:>7.0f} | "
                    f"{owned_s * 1e3:>12.1f} {megabytes / owned_s:>7.0f}",
                    flush=True,
                )
    finally:
        parent_conn.send_bytes(json.dumps({"op": "stop"}).encode())
        child.join(10)
        if child.is_alive():
            child.kill()
    print(f"(median of {args.repeats} syncs per cell; total {time.perf_counter() - started:.0f}s)")
    if args.grpo_steps > 1:
        grpo_table(args)


def grpo_table(args: argparse.Namespace) -> None:
    """The second table: the sync's share of a GRPO step, per model and engine placement."""
    started = time.perf_counter()
    print(f"\nGRPO steps 2..{args.grpo_steps} (median); target: sync < 5% of a step")
    header = f"{'model':>6} {'engine':>10} | {'step s':>7} | {'sync ms':>8} | {'sync / step':>11}"
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory(prefix="bench-sync-models-") as cache:
        for model in args.grpo_models.split(","):
            overrides = grpo_model_overrides(model, Path(cache)) + args.grpo_args.split()
            for r in grpo_sync_fraction(args.grpo_steps, overrides):
                print(
                    f"{model:>6} {r['process']:>10} | {r['step_s']:>7.2f} | {r['sync_s'] * 1e3:>8.1f} | "
                    f"{r['fraction']:>10.1%}",
                    flush=True,
                )
    print(f"(total {time.perf_counter() - started:.0f}s)")


if __name__ == "__main__":
    main()
