"""GRPO step time: rltrain's GRPO (CLI, vLLM CPU rollout) vs TRL's GRPOTrainer (transformers generate).

Fixed config on both sides: the ~10M-parameter model every benchmark uses (bench_sft.py: Qwen2,
hidden 384, 6 layers, built locally; `--model tiny` takes rltrain's 0.8M default instead, where
per-call framework overhead rather than compute sets the pace), the built-in addition task and
its reward (`rltrain.rewards.builtin.addition_reward`), the same prompts in the same order
(rltrain's prompt stream is replayed for TRL), 16 prompts x 8 completions per step, temperature
1.0, top-p 1.0, no top-k, at most `--max-new-tokens` new tokens, clipped token-level loss (clip
0.2 / 0.28, no KL, group-scaled advantages), one optimizer step per generation, activations kept
(no gradient checkpointing, which TRL's configs turn on by default), fp32 on CPU.

rltrain runs through its CLI (`python -m rltrain algo=grpo ...`, vLLM's CPU build in-process, the
policy on the FSDP engine, weights synced to vLLM every step) and the table reads its
`metrics.jsonl` (`time/step`, `time/rollout`, `time/train`, `time/sync`,
`rollout/tokens_per_s`). TRL's colocated vLLM path fails on vLLM's CPU build, so TRL is run with
`use_vllm=False` (its transformers-generation path): the comparison is rltrain+vLLM vs
TRL+transformers.generate, and the output says so. TRL's step time is measured from its
`on_step_begin` to `on_step_end` callbacks (generation happens inside the step); its rollout time
wraps its generation call.

The two sides run one after the other (a CLI run is its own process), alternating `--rounds`
times, because the CPU is shared with other jobs and load drifts; medians over all timed steps are
reported.

    .venv/bin/python scripts/bench_grpo.py [--model bench|tiny] [--steps 4] [--warmup 1] [--max-new-tokens 32] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from bench_common import (
    THREADS_HELP,
    GRPOShape,
    GRPOStepRow,
    bench_model_dir,
    grpo_prompt_stream,
    print_table,
    quiet_transformers,
    trl_available,
    trl_grpo_steps,
)

REPO = Path(__file__).resolve().parents[1]
SHAPE = GRPOShape()  # 16 prompts x 8, lr 2e-3, clip 0.2 / 0.28, 16 held-out problems
PROMPTS, GROUP, LR, CLIP_LOW, CLIP_HIGH, NUM_EVAL = (SHAPE.prompts, SHAPE.group, SHAPE.lr, SHAPE.clip_low,
                                                     SHAPE.clip_high, SHAPE.num_eval)
StepRow = GRPOStepRow


def tiny_model_dir(cache: Path) -> Path:
    """The embedded default model (rltrain's ModelConfig defaults), built once into `cache`."""
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    return build_tiny_model_dir(ModelConfig(cache_dir=str(cache)), seed=0)


def run_rltrain(model_dir: Path, run_dir: Path, total_steps: int, max_new: int, threads: int) -> list[StepRow]:
    """One CLI run; the per-step rows of its metrics.jsonl."""
    cmd = [
        sys.executable, "-m", "rltrain", "algo=grpo", f"model.path={model_dir}", f"hydra.run.dir={run_dir}",
        f"trainer.max_steps={total_steps}", "trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=lines",
        f"trainer.num_threads={threads}", f"data.num_eval={NUM_EVAL}", "trainer.seed=0", "rollout.seed=0",
        f"algo.prompts_per_step={PROMPTS}", f"algo.group_size={GROUP}", f"algo.max_new_tokens={max_new}",
        "algo.temperature=1.0", "algo.top_p=1.0", "algo.beta=0.0", f"algo.clip_low={CLIP_LOW}",
        f"algo.clip_high={CLIP_HIGH}", "algo.loss_agg=token_mean", "algo.scale_rewards=group",
        f"optim.lr={LR}", "optim.schedule=constant", "optim.warmup_steps=0", "optim.max_grad_norm=1.0",
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"rltrain CLI failed ({done.returncode}):\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "time/step" in r]


def med(rows: list[StepRow], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", choices=("bench", "tiny"), default="bench",
        help="bench: the ~10M-parameter benchmark model; tiny: rltrain's 0.8M default",
    )
    parser.add_argument("--steps", type=int, default=4, help="timed steps per system and round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (vLLM and allocator warm-up)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="alternate rltrain and TRL this many times")
    parser.add_argument(
        "--threads", type=int, default=1,
        help=THREADS_HELP,
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    total = args.steps + args.warmup
    ours: list[StepRow] = []
    theirs: list[StepRow] = []
    with_trl = trl_available()
    if not with_trl:
        print("TRL is not importable: install trl==1.16.0 to compare")
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        model_dir = bench_model_dir(cache) if args.model == "bench" else tiny_model_dir(cache)
        n_params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(model_dir).parameters())
        rows = grpo_prompt_stream(model_dir, total, SHAPE)
        for r in range(args.rounds):
            ours += run_rltrain(model_dir, Path(tmp) / f"rltrain{r}", total, args.max_new_tokens, args.threads)[args.warmup :]
            if with_trl:
                theirs += trl_grpo_steps(model_dir, rows, total, args.max_new_tokens, Path(tmp) / f"trl{r}", SHAPE)[args.warmup :]

    ours_step = med(ours, "time/step")
    table = [[
        "rltrain GRPO (vLLM CPU rollout)", f"{ours_step:.3f}", f"{med(ours, 'time/rollout'):.3f}",
        f"{med(ours, 'time/train'):.3f}", f"{med(ours, 'time/sync'):.3f}", f"{med(ours, 'rollout/tokens_per_s'):.0f}", "",
    ]]
    notes = []
    if theirs:
        trl_step = med(theirs, "time/step")
        trl_tps = statistics.median(r["rollout_tokens"] / r["time/rollout"] for r in theirs)
        table[0][-1] = f"{ours_step / trl_step:.2f}"
        table.append([
            "TRL GRPOTrainer (use_vllm=False)", f"{trl_step:.3f}", f"{med(theirs, 'time/rollout'):.3f}",
            f"{statistics.median(r['time/step'] - r['time/rollout'] for r in theirs):.3f}", "-", f"{trl_tps:.0f}", "1.00",
        ])
        notes.append(
            "TRL uses transformers generate (use_vllm=False): its colocated vLLM path fails on vLLM's CPU build. "
            "TRL's 'train' column is step minus generation (rewards, log-probs, backward, optimizer)."
        )
    notes.append("CPU shared with other jobs: timings are noisy; medians over all timed steps.")
    print_table(
        f"GRPO, {args.model} model ({n_params / 1e6:.2f}M params), addition task, {PROMPTS} prompts x {GROUP} completions, "
        f"max {args.max_new_tokens} new tokens, {args.steps} timed steps (+{args.warmup} warm-up) x {args.rounds} round(s), "
        f"{args.threads} threads, CPU fp32",
        ["system", "step s", "rollout s", "train s", "sync s", "rollout tok/s", "step vs TRL"], table, notes,
    )


if __name__ == "__main__":
    main()
