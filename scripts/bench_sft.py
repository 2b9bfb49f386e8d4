"""SFT throughput: rltrain's FSDP engine vs TRL's SFTTrainer on the same model, data and batches.

Model: ~10M parameters shaped like the tiny default (Qwen2, hidden 384, 6 layers, head size 32),
built locally. Data: prompt/completion rows of 30-250 tokens (character tokenizer). Both sides
train on the same batches in the same order (TRL's sampler is set to sequential), with the same
global batch, no packing, completion-only loss, activations kept (no gradient checkpointing, which
TRL's configs turn on by default), fp32, on CPU; TRL runs through its normal
`SFTTrainer(...).train()` API with its default padding (to the longest sequence of the batch).
The table reports tokens/s (prompt + completion tokens processed per second) and the median step
time after warm-up steps.

Why interleaved: the development machines share two cores with other jobs, so load drifts by
several x within minutes. rltrain's step k runs right after TRL's step k (from a TRL callback,
outside TRL's timed region), so both systems see the same load, and the per-step time ratio on
the same batch is the robust comparison; it is printed as well.

    .venv/bin/python scripts/bench_sft.py [--steps 6] [--warmup 1] [--batch 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from bench_common import (
    THREADS_HELP,
    Timing,
    bench_model_dir,
    count_params,
    init_single_rank,
    paired_ratio,
    per_step,
    print_table,
    quiet_transformers,
    run_interleaved,
    sft_row_tokens,
    summarise,
    trl_args,
    trl_sft_trainer,
    trl_step_timer,
)


def make_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Prompt/completion rows of 30-250 characters (= tokens for the character tokenizer)."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 +=-"
    rows = []
    for _ in range(n):
        total = rng.randint(30, 250)
        prompt_len = rng.randint(5, total // 2)
        text = "".join(rng.choice(alphabet) for _ in range(total - 1))  # + EOS = total tokens
        rows.append({"prompt": text[:prompt_len], "completion": text[prompt_len:]})
    return rows


class RltrainSFT:
    """rltrain's side: the FSDP engine on one rank, `sft_loss`, batches tokenized up front (TRL's
    dataset is tokenized before training too, so neither side times tokenization)."""

    def __init__(
        self, model_dir: Path, rows: list[dict[str, str]], batch: int, total_steps: int, buckets: bool = True
    ) -> None:
        from rltrain.algos.sft import sft_loss
        from rltrain.backends.fsdp.engine import FSDPEngine
        from rltrain.config.group_options import FSDPBackendConfig
        from rltrain.config.schema import OptimConfig
        from rltrain.data.batch import SequenceBatch
        from rltrain.models.tokenizer import load_tokenizer

        tok = load_tokenizer(model_dir)
        self.loss_fn = sft_loss
        optim = OptimConfig(lr=1e-4, warmup_steps=0, schedule="constant", beta2=0.999, max_grad_norm=1.0)
        backend = FSDPBackendConfig(length_buckets=buckets)  # the ablation is the backend's own switch
        self.engine = FSDPEngine(model_dir, backend, optim, total_steps, torch.device("cpu"))
        self.batches: list[tuple[SequenceBatch, int]] = []
        for step in range(total_steps):
            chunk = rows[step * batch : (step + 1) * batch]
            prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in chunk]
            completions = [tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in chunk]
            n_tokens = sum(len(p) + len(c) for p, c in zip(prompts, completions))
            mb = SequenceBatch.from_lists(prompts, completions, global_tokens=float(sum(len(c) for c in completions)))
            self.batches.append((mb, n_tokens))

    def step(self, k: int) -> Timing:
        mb, n_tokens = self.batches[k]
        t0 = time.perf_counter()
        self.engine.train_step([mb], self.loss_fn)
        return time.perf_counter() - t0, n_tokens


def run_trl_sft(
    model_dir: Path, rows: list[dict[str, str]], batch: int, total_steps: int, out_dir: Path,
    after_step: Callable[[int], None],
) -> list[Timing]:
    """TRL's SFTTrainer through its normal API; `after_step(k)` runs after TRL's step k is timed."""
    times: list[float] = []
    args = trl_args(out_dir, micro=batch, accumulation=1, steps=total_steps, lr=1e-4, device=torch.device("cpu"), bf16=False)
    trainer = trl_sft_trainer(model_dir, rows[: total_steps * batch], args, 512, torch.float32, trl_step_timer(times, after_step))
    tokens = sft_row_tokens(trainer)
    trainer.train()
    return per_step(tokens, batch, times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per system")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=16, help="sequences per optimizer step (one micro-batch)")
    parser.add_argument(
        "--threads", type=int, default=1,
        help=THREADS_HELP,
    )
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--ablate-buckets", action="store_true", help="add a row: rltrain without length buckets")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    init_single_rank(args.port)
    total = args.steps + args.warmup
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_model_dir(Path(tmp) / "cache")
        n_params = count_params(model_dir)
        rows = make_rows(total * args.batch)
        systems = {"rltrain (FSDP engine)": RltrainSFT(model_dir, rows, args.batch, total)}
        if args.ablate_buckets:
            systems["rltrain, no length buckets"] = RltrainSFT(model_dir, rows, args.batch, total, buckets=False)
        ours, theirs = run_interleaved(
            systems, total, lambda steps: run_trl_sft(model_dir, rows, args.batch, total, Path(tmp) / "trl", steps)
        )
    ours = {name: timings[args.warmup :] for name, timings in ours.items()}
    theirs = theirs[args.warmup :]
    trl_tps = summarise(theirs)[0] if theirs else None
    table = []
    for name, timings in ours.items():
        tps, step_s = summarise(timings)
        table.append([name, f"{tps:.0f}", f"{step_s:.3f}", f"{tps / trl_tps:.2f}x" if trl_tps else "-"])
    notes = []
    if theirs:
        table.append(["TRL SFTTrainer", f"{trl_tps:.0f}", f"{summarise(theirs)[1]:.3f}", "1.00x"])
        for name, timings in ours.items():
            if [n for _, n in timings] != [n for _, n in theirs]:
                notes.append(f"warning: {name} and TRL counted different tokens per batch")
            notes.append(f"paired per-step speed-up of {name} (TRL step s / its step s, same batch): {paired_ratio(timings, theirs)}")
    notes.append("CPU shared with other jobs: timings are noisy; steps are interleaved so both see the same load.")
    print_table(
        f"SFT, {n_params / 1e6:.1f}M params, batch {args.batch} sequences of 30-250 tokens, "
        f"{args.steps} timed steps (+{args.warmup} warm-up), {args.threads} threads, CPU fp32",
        ["system", "tokens/s", "step s (median)", "tokens/s vs TRL"], table, notes,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
