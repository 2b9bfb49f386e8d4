"""bench_gpu.py's TRL side: TRL 1.16's SFT, DPO and GRPO trainers on the same model, rows, batch
and micro-batch as rltrain's rows, each step timed by a trainer callback (what each trainer's step
contains is in bench_gpu.py's docstring). TRL is a benchmark peer (pinned with the test tools, not
a dependency of rltrain): it is imported only when a trainer is built. The benchmark and its numbers: docs/benchmarks.md and docs/gpus.md.
"""

from __future__ import annotations

from pathlib import Path

import torch
from bench_common import (
    cuda_peak_gib,
    dpo_pair_tokens,
    load_trl_model,
    per_step,
    release_memory,
    sft_row_tokens,
    silence_trainer,
    trl_args,
    trl_dpo_trainer,
    trl_sft_trainer,
    trl_step_timer,
)
from gpu_rows import (
    CLIP_HIGH,
    CLIP_LOW,
    DPO_BETA,
    LR,
    fixed_rollouts,
    grpo_sequences,
    max_completion,
    total_steps,
)

TRL_NAMES = {"sft": "SFTTrainer", "dpo": "DPOTrainer", "grpo": "GRPOTrainer update"}


def _unused_reward(**_) -> list[float]:
    """GRPOTrainer needs a reward function; the update benchmark bypasses scoring, so never called."""
    raise AssertionError("the GRPO update benchmark scores nothing: its rollouts come with advantages")


def trl_grpo_update_trainer(model_dir: Path, rows, args, trainer_args: dict, dtype: torch.dtype, callback):
    """TRL's GRPOTrainer whose generation and scoring return our fixed rollouts (see
    bench_gpu.py's docstring); (trainer, tokens of each sequence in step order)."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import pad

    from rltrain.models.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    total = total_steps(args)
    steps = [fixed_rollouts(tok, rows, k, args.batch, args.group, args.row_length) for k in range(total)]
    prompts_per_step = grpo_sequences(args.batch, args.group) // args.group
    dataset = datasets.Dataset.from_list(
        [{"prompt": r["prompt"]} for k in range(total) for r in rows[k * args.batch : (k + 1) * args.batch][:prompts_per_step]]
    )
    config = GRPOConfig(
        **trainer_args, num_generations=args.group, max_completion_length=max_completion(args), use_vllm=False, beta=0.0,
        epsilon=CLIP_LOW, epsilon_high=CLIP_HIGH, loss_type="dapo", num_iterations=1, shuffle_dataset=False,
    )
    trainer = GRPOTrainer(
        model=load_trl_model(model_dir, dtype), reward_funcs=[_unused_reward], args=config, train_dataset=dataset,
        processing_class=tok, callbacks=[callback],
    )
    silence_trainer(trainer)
    device, pad_id = trainer.accelerator.device, tok.pad_token_id
    fed = iter(steps)

    def scored_rollouts(generation_batch) -> dict[str, torch.Tensor]:
        """What `_generate_and_score_completions` returns here once it has generated and scored,
        built as its own code builds it (no old or reference log-probabilities: one iteration,
        beta 0)."""
        r = next(fed)
        prompt_ids = [torch.tensor(ids) for ids in r.prompts]
        completion_ids = [torch.tensor(ids) for ids in r.completions]
        completion_mask = pad([torch.ones_like(c) for c in completion_ids], padding_value=0, padding_side="right").to(device)
        return {
            "prompt_ids": pad(prompt_ids, padding_value=pad_id, padding_side="left").to(device),
            "prompt_mask": pad([torch.ones_like(p) for p in prompt_ids], padding_value=0, padding_side="left").to(device),
            "completion_ids": pad(completion_ids, padding_value=pad_id, padding_side="right").to(device),
            "completion_mask": completion_mask,
            "advantages": torch.tensor(r.adv_B, device=device),
            "num_items_in_batch": completion_mask.sum(),
        }

    trainer._generate_and_score_completions = scored_rollouts
    return trainer, [len(p) + len(c) for r in steps for p, c in zip(r.prompts, r.completions)]


def run_trl(name: str, model_dir: Path, rows, args, precision, device: torch.device, out_dir: Path) -> dict:
    """TRL 1.16's trainer for workload `name` on the same rows, batch and micro-batch (bench_gpu.py's docstring);
    with --profile, the step after the timed ones under the profiler (started and stopped by the step
    timer's callback, after the timed step's end)."""
    from gpu_profile import StepProfiler

    total, last_timed = total_steps(args), args.warmup + args.steps - 1
    times: list[float] = []
    profiler = StepProfiler(args.profile, f"{args.rows} TRL {TRL_NAMES[name]}", device) if args.profile else None

    def after_step(k: int) -> None:
        if profiler is not None and k == last_timed:
            profiler.start()
        elif profiler is not None and k == last_timed + 1:
            profiler.stop()

    timer = trl_step_timer(times, after_step)

    def trainer_args(accumulation: int) -> dict:
        return trl_args(out_dir / name, micro=args.micro, accumulation=accumulation, steps=total, lr=LR, device=device,
                        bf16=precision.mixed)

    if name == "sft":
        trainer = trl_sft_trainer(model_dir, rows[: total * args.batch], trainer_args(args.batch // args.micro),
                                  max(2048, args.row_length),
                                  precision.param_dtype, timer)
        row_tokens, rows_per_step = sft_row_tokens(trainer), args.batch
    elif name == "dpo":
        pairs = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": r["rejected"]} for r in rows[: total * args.batch]]
        trainer = trl_dpo_trainer(model_dir, pairs, trainer_args(args.batch // args.micro), DPO_BETA, None,
                                  precision.param_dtype, timer)
        row_tokens, rows_per_step = dpo_pair_tokens(trainer), args.batch
    else:
        rows_per_step = grpo_sequences(args.batch, args.group)
        trainer, row_tokens = trl_grpo_update_trainer(
            model_dir, rows, args, trainer_args(rows_per_step // args.micro), precision.param_dtype, timer
        )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    timed = per_step(row_tokens, rows_per_step, times)[args.warmup : last_timed + 1]
    out = {
        "tokens/s": sum(n for _, n in timed) / sum(t for t, _ in timed),
        "step tokens": [n for _, n in timed],
        "peak GiB": cuda_peak_gib(device),
    }
    del trainer
    release_memory(device)
    return out
