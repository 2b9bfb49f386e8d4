"""Benchmark generating ahead and weights in flight (docs/async.md): the default GRPO loop
synchronous, with k = 1 and k = 2 (between batches), and in flight with streaming (k = 1,
`placement.weight_update=in_flight placement.stream=true`), vLLM in its own process, on the default
workload and on a long-tail one, for each split of this machine's cores between the trainer and
the engine.

    .venv/bin/python scripts/bench_async.py                      # every workload, mode and split
    .venv/bin/python scripts/bench_async.py --steps 20 --splits 1/1 --repeat 2
    .venv/bin/python scripts/bench_async.py --workloads long-tail --modes sync,k=1,in-flight+stream

Each run is `python -m rltrain` on the embedded default (its SFT start built once and cached) for
`--steps` steps without evaluation or checkpoints; the first `--warmup` steps are left out and the
medians of the rest are reported (with `--repeat N` the runs of every row are interleaved, a
workload's modes side by side, and the median of their medians reported: a slow spell of a shared
machine then hits every row). `alone` is max(rollout, train) of the synchronous run with the same
threads, where each half runs with the other idle: the best an overlapped step can do.

The long-tail workload is the default command on a model whose completions end at random
lengths, most within a few tokens and a few running to the budget (`algo.max_new_tokens=48`), so
a step's batch waits for its slowest few sequences (the shape in-flight updates and streaming are
for): the default's tiny model before its SFT, with the output row of its end-of-sequence token
set so that at the mean final hidden state the odds of stopping are 1 : 9 (`long_tail_model`: a
~10% chance to stop at each token on average, more in some contexts, less in others; built once, cached beside the tiny model), trained at `optim.lr=1e-12` so that the
lengths stay long-tailed over the run (GRPO shortens them within a few steps otherwise). It
measures speed, not learning. The table prints each row's mean completion length.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STOP_CHANCE = 0.1  # the long-tail model's mean chance to end at a token (module doc)
# optim.lr=1e-12: every step trains as usual, but the model (so its length distribution) stays put;
# at the default rate GRPO shortens this model's completions within a few steps.
WORKLOADS = {"default": [], "long-tail": ["model.sft_steps=0", "algo.max_new_tokens=48", "optim.lr=1e-12"]}
MODES = {
    "sync": ["placement.max_staleness=0"],
    "k=1": ["placement.max_staleness=1"],
    "k=2": ["placement.max_staleness=2"],
    "in-flight+stream": ["placement.max_staleness=1", "placement.weight_update=in_flight", "placement.stream=true"],
}
KEYS = ("time/step", "time/rollout", "time/train", "rollout/response_length_mean")


def run(run_dir: Path, steps: int, overrides: list[str], trainer_threads: int, engine_threads: int) -> list[dict]:
    cmd = [
        sys.executable, "-m", "rltrain", f"trainer.max_steps={steps}", "trainer.eval_every=0", "trainer.save_every=0",
        "logger.wandb.mode=disabled", "trainer.progress=lines", "rollout=vllm", "rollout.process=separate",
        f"trainer.num_threads={trainer_threads}", f"rollout.num_threads={engine_threads}", *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r]


def long_tail_model() -> Path:
    """The long-tail workload's model (module doc): the default's tiny model before SFT, whose
    end-of-sequence row (tied: input and output) is set along the mean final hidden state of
    random prompts so that stopping has odds STOP_CHANCE : 1 - STOP_CHANCE there."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from rltrain.models.model_dir import resolve_model_dir
    from rltrain.serve import compose_run_config

    cfg = compose_run_config(["model.sft_steps=0"])
    base = Path(resolve_model_dir(cfg.model, cfg.data, cfg.trainer))
    out = base.with_name(f"{base.name}-longtail-{STOP_CHANCE:g}")
    if (out / "model.safetensors").exists():
        return out
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    eos = model.config.eos_token_id
    with torch.no_grad():
        prompts_BT = torch.randint(3, model.config.vocab_size, (32, 12), generator=torch.Generator().manual_seed(0))
        hidden_NH = model.model(prompts_BT).last_hidden_state.flatten(0, 1)
        logits_NV = hidden_NH @ model.get_input_embeddings().weight.T
        others = torch.logsumexp(torch.cat([logits_NV[:, :eos], logits_NV[:, eos + 1 :]], dim=1), dim=1).mean()
        mean_H = hidden_NH.mean(0)
        odds = torch.log(torch.tensor(STOP_CHANCE / (1 - STOP_CHANCE)))
        model.get_input_embeddings().weight[eos] = (others + odds) * mean_H / mean_H.dot(mean_H)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp)
    model.save_pretrained(tmp)
    tmp.rename(out)
    return out


def medians(rows: list[dict], warmup: int) -> dict[str, float]:
    timed = rows[warmup:]
    out = {key: statistics.median(r.get(key, 0.0) for r in timed) for key in KEYS}
    out["idle"] = statistics.median(r.get("time/wait_rollout", 0.0) / r["time/step"] for r in timed)
    return out


def measure(args: argparse.Namespace, extra: list[str]) -> dict[tuple[str, str, str], dict[str, float]]:
    """Every (workload, split, mode) `args.repeat` times, interleaved; the median of each key's medians."""
    runs: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        for attempt in range(args.repeat):
            for workload in args.workloads.split(","):
                for split in args.splits.split(","):
                    trainer_threads, engine_threads = (int(x) for x in split.split("/"))
                    for mode in args.modes.split(","):
                        name = f"{workload}-{split.replace('/', '-')}-{mode}-{attempt}".replace("+", "_").replace("=", "")
                        rows = run(Path(tmp) / name, args.steps, [*WORKLOADS[workload], *MODES[mode], *extra],
                                   trainer_threads, engine_threads)
                        runs.setdefault((workload, split, mode), []).append(medians(rows, args.warmup))
                        print(f"{workload}, split {split}, {mode}: {runs[(workload, split, mode)][-1]['time/step']:.3f} s/step",
                              file=sys.stderr, flush=True)
    return {row: {key: statistics.median(m[key] for m in done) for key in done[0]} for row, done in runs.items()}


def print_tables(results: dict[tuple[str, str, str], dict[str, float]], args: argparse.Namespace, cores: int) -> None:
    repeats = f", medians of {args.repeat} interleaved runs" if args.repeat > 1 else ""
    print(f"\nthe default GRPO step, {args.steps} steps (median after {args.warmup}{repeats}), {cores} cores, "
          f"vLLM in its own process{' ' + ' '.join(args.extra) if args.extra else ''}")
    print(f"{'workload':<11}{'threads':<9}{'mode':<18}{'step s':>8}{'rollout s':>11}{'train s':>9}{'idle':>7}"
          f"{'length':>8}{'vs sync':>9}{'vs k=1':>8}{'vs alone':>10}")
    for (workload, split, mode), m in results.items():
        sync = results.get((workload, split, "sync"))
        ahead = results.get((workload, split, "k=1"))
        vs_sync = f"{m['time/step'] / sync['time/step']:.2f}x" if sync else "-"
        vs_k1 = f"{m['time/step'] / ahead['time/step']:.2f}x" if ahead else "-"
        vs_alone = f"{m['time/step'] / max(sync['time/rollout'], sync['time/train']):.2f}x" if sync else "-"
        print(f"{workload:<11}{split:<9}{mode:<18}{m['time/step']:>8.3f}{m['time/rollout']:>11.3f}{m['time/train']:>9.3f}"
              f"{m['idle']:>7.0%}{m['rollout/response_length_mean']:>8.1f}{vs_sync:>9}{vs_k1:>8}{vs_alone:>10}")
    print("idle: the trainer's share of the step spent waiting for its batch (time/wait_rollout / time/step).")
    print("length: mean completion tokens (rollout/response_length_mean).")
    print("vs k=1: step time / k=1's with the same workload and threads (in-flight+stream goal: <= 0.8x on the long "
          "tail, <= 1.0x on the default).")
    print("vs alone: step time / max(rollout, train) of the synchronous run with the same threads (target <= 1.15).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=1, help="runs per row, interleaved; the median of their medians")
    cores = len(os.sched_getaffinity(0))
    default_splits = sorted({f"{cores}/{cores}", f"{max(1, cores // 2)}/{max(1, cores - cores // 2)}"})
    parser.add_argument("--splits", default=",".join(default_splits), help="trainer/engine threads, comma-separated")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides added to every run")
    args = parser.parse_args()
    for given, known, flag in ((args.workloads, WORKLOADS, "--workloads"), (args.modes, MODES, "--modes")):
        unknown = [name for name in given.split(",") if name not in known]
        if unknown:
            parser.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if "long-tail" in args.workloads.split(","):
        WORKLOADS["long-tail"].append(f"model.path={long_tail_model()}")
    print_tables(measure(args, args.extra), args, cores)


if __name__ == "__main__":
    main()
