"""DPO throughput: rltrain (FSDP engine policy + frozen reference) vs TRL's DPOTrainer.

Same ~10M-parameter model as bench_sft.py (Qwen2, hidden 384, 6 layers, head size 32) for the
policy and the reference, same preference rows (prompt 10-80 tokens, chosen and rejected 10-170
tokens each, drawn independently, so every pair is ragged), same batches in the same order (TRL's
sampler is sequential), sigmoid loss with beta 0.1, an online reference forward every step on both
sides (no precomputed reference log-probabilities), activations kept (no gradient checkpointing,
which TRL's configs turn on by default), fp32 on CPU. TRL runs through its normal
`DPOTrainer(...).train()` API with an explicit `ref_model` and its default padding. Our side is
`rltrain.algos.dpo` (`dpo_micro_batches`, `attach_reference`, `make_dpo_loss`) on
`rltrain.backends.fsdp.engine.FSDPEngine`, one rank over gloo; the timed step includes the reference
forward.

Tokens/s counts the tokens of each step's sequences, the same number for both sides: 2 x prompt +
chosen + rejected per pair (the reference forward is not counted again). That is the work asked
for, not what each side feeds its model: rltrain packs a pair's prompt, chosen and rejected into
one row and computes the prompt once (rltrain/backends/fsdp/micro_batches/shared_prefix.py; `--ablate-packing` shows
what that buys), TRL pads chosen and rejected each with its own copy of the prompt. Steps are interleaved (rltrain's step k runs
right after TRL's step k, from a TRL callback outside TRL's timed region) because the CPU is
shared with other jobs; the per-step ratio on the same batch is printed too.

    .venv/bin/python scripts/bench_dpo.py [--steps 6] [--warmup 1] [--pairs 8] [--threads 1]
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
    dpo_pair_tokens,
    init_single_rank,
    paired_ratio,
    per_step,
    print_table,
    quiet_transformers,
    run_interleaved,
    summarise,
    trl_args,
    trl_dpo_trainer,
    trl_step_timer,
)

BETA = 0.1
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +=-"


def make_pairs(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Preference rows; chosen and rejected lengths are independent (10x apart at the extremes)."""
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(lo, hi)))

    return [{"prompt": text(10, 80), "chosen": text(9, 169), "rejected": text(9, 169)} for _ in range(n)]


class RltrainDPO:
    """rltrain's side, with every batch tokenized up front (TRL tokenizes its dataset before
    training too); `step(k)` = reference forward + policy train step on batch k."""

    def __init__(
        self, model_dir: Path, rows: list[dict[str, str]], pairs_per_step: int, total_steps: int,
        buckets: bool = True, packing: bool = True,
    ) -> None:
        from rltrain.algos.dpo import attach_reference, dpo_micro_batches, make_dpo_loss
        from rltrain.backends.fsdp.engine import FSDPEngine
        from rltrain.config.group_options import FSDPBackendConfig
        from rltrain.config.schema import OptimConfig
        from rltrain.data.preference_data import PreferencePair
        from rltrain.models.tokenizer import load_tokenizer

        tok = load_tokenizer(model_dir)

        def enc(s: str) -> list[int]:
            return tok(s, add_special_tokens=False)["input_ids"]

        eos = tok.eos_token_id
        self.pairs = [PreferencePair(enc(r["prompt"]), enc(r["chosen"]) + [eos], enc(r["rejected"]) + [eos]) for r in rows]
        self.per_step = pairs_per_step
        optim = OptimConfig(lr=1e-4, warmup_steps=0, schedule="constant", beta2=0.999, max_grad_norm=1.0)
        cpu = torch.device("cpu")
        # The ablations are the backend's own switches (backend.length_buckets, backend.share_prompts).
        backend = FSDPBackendConfig(length_buckets=buckets, share_prompts=packing)
        self.policy = FSDPEngine(model_dir, backend, optim, total_steps, cpu)
        self.reference = FSDPEngine(model_dir, backend, None, total_steps, cpu)
        self.loss_fn = make_dpo_loss(BETA, "sigmoid", 0.0, 0.0)
        self._micro = dpo_micro_batches
        self._attach = attach_reference

    def tokens(self, k: int) -> int:
        chunk = self.pairs[k * self.per_step : (k + 1) * self.per_step]
        return sum(2 * len(p.prompt) + len(p.chosen) + len(p.rejected) for p in chunk)

    def step(self, k: int) -> Timing:
        chunk = self.pairs[k * self.per_step : (k + 1) * self.per_step]
        t0 = time.perf_counter()
        micro, _ = self._micro(chunk, 0, 1, len(chunk))
        self._attach(micro, self.reference)
        self.policy.train_step(micro, self.loss_fn)
        return time.perf_counter() - t0, self.tokens(k)


def run_trl_dpo(
    model_dir: Path, rows: list[dict[str, str]], pairs_per_step: int, total_steps: int, out_dir: Path,
    after_step: Callable[[int], None],
) -> list[Timing]:
    """TRL's DPOTrainer through its normal API; `after_step(k)` runs after TRL's step k is timed."""
    times: list[float] = []
    args = trl_args(
        out_dir, micro=pairs_per_step, accumulation=1, steps=total_steps, lr=1e-4, device=torch.device("cpu"), bf16=False
    )
    trainer = trl_dpo_trainer(
        model_dir, rows[: total_steps * pairs_per_step], args, BETA, 1024, torch.float32, trl_step_timer(times, after_step)
    )
    tokens = dpo_pair_tokens(trainer)
    trainer.train()
    return per_step(tokens, pairs_per_step, times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per system")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--pairs", type=int, default=8, help="preference pairs per optimizer step (one micro-batch)")
    parser.add_argument(
        "--threads", type=int, default=1,
        help=THREADS_HELP,
    )
    parser.add_argument("--port", type=int, default=29534)
    parser.add_argument("--ablate-buckets", action="store_true", help="add a row: rltrain without length buckets")
    parser.add_argument(
        "--ablate-packing", action="store_true",
        help="add a row: rltrain scoring chosen and rejected as separate rows (the prompt twice)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    init_single_rank(args.port)
    total = args.steps + args.warmup
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_model_dir(Path(tmp) / "cache")
        n_params = count_params(model_dir)
        rows = make_pairs(total * args.pairs)
        systems = {"rltrain (FSDP engine)": RltrainDPO(model_dir, rows, args.pairs, total)}
        if args.ablate_buckets:
            systems["rltrain, no length buckets"] = RltrainDPO(model_dir, rows, args.pairs, total, buckets=False)
        if args.ablate_packing:
            systems["rltrain, prompt not shared"] = RltrainDPO(model_dir, rows, args.pairs, total, packing=False)
        ours, theirs = run_interleaved(
            systems, total, lambda steps: run_trl_dpo(model_dir, rows, args.pairs, total, Path(tmp) / "trl", steps)
        )
    ours = {name: timings[args.warmup :] for name, timings in ours.items()}
    theirs = theirs[args.warmup :]

    def row(name: str, timings: list[Timing]) -> list[str]:
        tps, step_s = summarise(timings)
        return [name, f"{args.pairs * len(timings) / sum(t for t, _ in timings):.2f}", f"{tps:.0f}", f"{step_s:.3f}", "-"]

    table = [row(name, timings) for name, timings in ours.items()]
    notes = []
    if theirs:
        for line, timings in zip(table, ours.values()):
            line[4] = f"{summarise(timings)[0] / summarise(theirs)[0]:.2f}x"
        table.append(row("TRL DPOTrainer", theirs))
        table[-1][4] = "1.00x"
        for name, timings in ours.items():
            if [n for _, n in timings] != [n for _, n in theirs]:
                notes.append(f"warning: {name} and TRL counted different tokens per batch")
            notes.append(f"paired per-step speed-up of {name} (TRL step s / its step s, same batch): {paired_ratio(timings, theirs)}")
    notes.append("CPU shared with other jobs: timings are noisy; steps are interleaved so both see the same load.")
    print_table(
        f"DPO (sigmoid, beta {BETA}, online reference), {n_params / 1e6:.1f}M params, {args.pairs} pairs per step, "
        f"{args.steps} timed steps (+{args.warmup} warm-up), {args.threads} threads, CPU fp32",
        ["system", "pairs/s", "tokens/s", "step s (median)", "tokens/s vs TRL"], table, notes,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
