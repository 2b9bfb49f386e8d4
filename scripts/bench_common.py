"""What every benchmark script shares: the benchmark model, a single-rank process group, quiet
libraries, timing summaries, device syncs and peak memory, the printed table, the step-by-step
interleaving with TRL, and TRL's SFT and DPO trainers built the same way wherever they are compared
(arguments, step timer, token counts), and GRPO's prompt stream and TRL GRPOTrainer beside it, so two
benchmarks never drive TRL differently by accident.

The bench scripts import from here, never from each other (bench_gpu.py's own parts are its gpu_*
siblings, which bench_lora.py shares).
"""

from __future__ import annotations

import datetime
import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

Timing = tuple[float, int]  # (seconds, tokens) of one optimizer step
THREADS_HELP = (
    "torch intra-op threads, the same for both sides (default 1: on the shared 2-core machines a "
    "second OpenMP thread mostly waits at barriers for a descheduled peer, which measures the "
    "scheduler, not the code; use 2+ on a quiet machine)"
)


def bench_model_dir(cache: Path) -> Path:
    """The ~10M-parameter model every benchmark uses (head size 32, as vLLM's CPU attention needs)."""
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(
        hidden_size=384, num_layers=6, num_heads=12, num_kv_heads=4, intermediate_size=1024,
        tie_word_embeddings=True, cache_dir=str(cache),
    )
    return build_tiny_model_dir(cfg, seed=0)


def count_params(model_dir: Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())


def init_single_rank(port: int) -> None:
    """rltrain's engines expect a process group; one rank over gloo has no communication cost."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=600))


def quiet_transformers() -> None:
    """Progress bars and warnings would drown the table."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    import datasets

    datasets.disable_progress_bars()


def silence_trainer(trainer) -> None:
    """With progress bars off, Trainer prints its log dicts instead; the table is the output."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)


def summarise(results: list[Timing]) -> tuple[float, float]:
    """(tokens/s over all timed steps, median step seconds)."""
    return sum(n for _, n in results) / sum(t for t, _ in results), statistics.median(t for t, _ in results)


def print_table(title: str, header: list[str], rows: list[list[str]], notes: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) + 2 for i in range(len(header))]
    print(f"\n{title}")
    print("".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
    for r in rows:
        print("".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    for note in notes:
        print(note)


def paired_ratio(ours: list[Timing], theirs: list[Timing]) -> str:
    """Median (min-max) of TRL step time / rltrain step time over the same batches."""
    ratios = sorted(t / o for (o, _), (t, _) in zip(ours, theirs))
    return f"{statistics.median(ratios):.2f}x (min {ratios[0]:.2f}, max {ratios[-1]:.2f}, {len(ratios)} steps)"


def trl_available() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def run_interleaved(
    systems: dict, total: int, run_trl: Callable[[Callable[[int], None]], list[Timing]]
) -> tuple[dict[str, list[Timing]], list[Timing]]:
    """Time our systems step by step, each step k right after TRL's step k (from TRL's callback,
    outside its timed region) so both see the same machine load. Without TRL, ours run alone."""
    ours: dict[str, list[Timing]] = {name: [] for name in systems}

    def our_steps(k: int) -> None:
        for name, system in systems.items():
            ours[name].append(system.step(k))

    theirs: list[Timing] = []
    if trl_available():
        theirs = run_trl(our_steps)
    else:
        print("TRL is not importable: install trl==1.16.0 to compare")
        for k in range(total):
            our_steps(k)
    return ours, theirs


def trl_args(
    out_dir: Path, *, micro: int, accumulation: int, steps: int, lr: float, device: torch.device, bf16: bool
) -> dict:
    """The TrainingArguments every TRL side shares: our optimizer settings (constant learning rate,
    gradient clipping at 1.0), `micro` rows per forward and `accumulation` forwards per optimizer
    step, and nothing that is not training (no logging, saving, reporting, progress bars or
    data-loading workers). `bf16` is autocast over fp32 weights, as our `bf16-mixed`. Activations
    are kept, as ours keep them (`model.gradient_checkpointing` is off by default): TRL's configs
    default to recomputing them in the backward, which would time a different workload."""
    return dict(
        output_dir=str(out_dir), per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", max_grad_norm=1.0,
        use_cpu=device.type != "cuda", dataloader_num_workers=0, seed=0, bf16=bf16, fp16=False,
        gradient_checkpointing=False, logging_steps=10**6, save_strategy="no", report_to=[], disable_tqdm=True,
    )


def require_activations_kept(model) -> None:
    """Refuse to time a TRL step that recomputes activations (TRL's configs default to it; ours keep
    them), so a change of TRL's defaults cannot make the comparison unequal unseen."""
    if model.is_gradient_checkpointing:
        raise RuntimeError("TRL's model recomputes activations (gradient checkpointing): pass gradient_checkpointing=False")


def trl_step_timer(times: list[float], after_step: Callable[[int], None] = lambda k: None):
    """A TrainerCallback appending each optimizer step's seconds to `times`: from `on_step_begin`
    (after the step's micro-batches are loaded) to `on_step_end` (after the optimizer step and
    zero_grad), CUDA-synchronised at both ends. `after_step(k)` runs after step k is timed, outside
    TRL's timed region (where `run_interleaved` runs our step k)."""
    from transformers import TrainerCallback

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class StepTimer(TrainerCallback):
        t0 = 0.0

        def on_step_begin(self, args, state, control, **kw):
            require_activations_kept(kw["model"])
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            times.append(time.perf_counter() - self.t0)
            after_step(len(times) - 1)

    return StepTimer()


def load_trl_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")


def trl_sft_trainer(model_dir: Path, rows: list[dict[str, str]], args: dict, max_length: int, dtype: torch.dtype, callback):
    """TRL's SFTTrainer through its normal API on prompt/completion `rows` in order (sequential
    sampler): completion-only loss, no packing, its default padding (to the batch's longest)."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    from rltrain.models.tokenizer import load_tokenizer

    config = SFTConfig(
        **args, completion_only_loss=True, packing=False, max_length=max_length, train_sampling_strategy="sequential"
    )
    ds = datasets.Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in rows])
    trainer = SFTTrainer(
        model=load_trl_model(model_dir, dtype), args=config, train_dataset=ds,
        processing_class=load_tokenizer(model_dir), callbacks=[callback],
    )
    silence_trainer(trainer)
    if len(trainer.train_dataset) != len(ds):
        raise RuntimeError("TRL dropped rows: the two sides would not see the same batches")
    return trainer


def sft_row_tokens(trainer) -> list[int]:
    """Tokens of each row as TRL's SFTTrainer tokenized it (prompt + completion + EOS)."""
    return [len(ids) for ids in trainer.train_dataset["input_ids"]]


def trl_dpo_trainer(
    model_dir: Path, rows: list[dict[str, str]], args: dict, beta: float, max_length: int | None, dtype: torch.dtype,
    callback,
):
    """TRL's DPOTrainer through its normal API on prompt/chosen/rejected `rows` in order
    (sequential sampler): sigmoid loss, an explicit frozen `ref_model` scored online every step
    (no precomputed reference log-probabilities), its default padding."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    from rltrain.models.tokenizer import load_tokenizer

    config = DPOConfig(
        **args, beta=beta, loss_type=["sigmoid"], precompute_ref_log_probs=False, max_length=max_length,
        train_sampling_strategy="sequential",
    )
    ds = datasets.Dataset.from_list(rows)
    trainer = DPOTrainer(
        model=load_trl_model(model_dir, dtype), ref_model=load_trl_model(model_dir, dtype), args=config,
        train_dataset=ds, processing_class=load_tokenizer(model_dir), callbacks=[callback],
    )
    silence_trainer(trainer)
    if len(trainer.train_dataset) != len(ds):
        raise RuntimeError("TRL dropped rows: the two sides would not see the same batches")
    return trainer


def dpo_pair_tokens(trainer) -> list[int]:
    """Tokens of each pair as TRL's DPOTrainer tokenized it, counted as both sides count them:
    2 x prompt + chosen + rejected (the prompt once per sequence)."""
    data = trainer.train_dataset
    return [2 * len(p) + len(c) + len(r) for p, c, r in zip(data["prompt_ids"], data["chosen_ids"], data["rejected_ids"])]


def per_step(row_tokens: list[int], rows_per_step: int, times: list[float]) -> list[Timing]:
    """(seconds, tokens) of each timed step, the rows taken in order `rows_per_step` at a time."""
    return [(t, sum(row_tokens[k * rows_per_step : (k + 1) * rows_per_step])) for k, t in enumerate(times)]


def cuda_sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA only), so a timer around a step sees all of it."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def cuda_peak_gib(device: torch.device) -> float | None:
    """`torch.cuda.max_memory_allocated` in GiB; None off CUDA."""
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def release_memory(device: torch.device) -> None:
    """Free the last workload before the next one, so its memory is not in the next peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class GRPOShape:
    """The GRPO step both sides of a GRPO benchmark run (bench_grpo.py, bench_moe.py): prompts x
    completions per step, the learning rate, the clip range and the held-out problems, whose count
    fixes the train split both sides draw prompts from."""

    prompts: int = 16
    group: int = 8
    lr: float = 2e-3
    clip_low: float = 0.2
    clip_high: float = 0.28
    num_eval: int = 16


GRPOStepRow = dict[str, float]


def grpo_prompt_stream(model_dir: Path, total_steps: int, shape: GRPOShape) -> list[dict[str, str]]:
    """The prompts rltrain's GRPO samples (`trainer.seed=0`), step by step (same split, same seeded
    stream), for TRL to see the same ones in the same order."""
    from rltrain.config.schema import DataConfig
    from rltrain.data.prompt_data import build_prompt_data
    from rltrain.data.sampler import IndexStream
    from rltrain.models.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    train, _, _ = build_prompt_data(tok, DataConfig(num_eval=shape.num_eval), 0)
    stream = IndexStream(len(train), 0)
    rows = []
    for _ in range(total_steps):
        rows += [{"prompt": train[i].text, "answer": str(train[i].columns["answer"])} for i in stream.take(shape.prompts)]
    return rows


def trl_grpo_steps(
    model_dir: Path, rows: list[dict[str, str]], total_steps: int, max_new: int, out_dir: Path, shape: GRPOShape
) -> list[GRPOStepRow]:
    """TRL's GRPOTrainer on the built-in task's reward, transformers-generate path (its colocated
    vLLM path fails on vLLM's CPU build): per-step `time/step`, `time/rollout` (its generation
    call) and `rollout_tokens`."""
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rltrain.models.tokenizer import load_tokenizer
    from rltrain.rewards.builtin import addition_reward

    tok = load_tokenizer(model_dir)
    steps: list[GRPOStepRow] = []
    rollout = {"s": 0.0, "tokens": 0}

    class StepTimer(TrainerCallback):
        t0 = 0.0

        def on_step_begin(self, args, state, control, **kw):
            require_activations_kept(kw["model"])
            rollout.update(s=0.0, tokens=0)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            step_s = time.perf_counter() - self.t0
            steps.append({"time/step": step_s, "time/rollout": rollout["s"], "rollout_tokens": rollout["tokens"]})

    config = GRPOConfig(
        output_dir=str(out_dir), per_device_train_batch_size=shape.prompts * shape.group, gradient_accumulation_steps=1,
        num_generations=shape.group, max_completion_length=max_new, temperature=1.0, top_p=1.0, top_k=0,
        use_vllm=False, beta=0.0, epsilon=shape.clip_low, epsilon_high=shape.clip_high, loss_type="dapo",
        scale_rewards="group", num_iterations=1, shuffle_dataset=False, max_steps=total_steps, learning_rate=shape.lr,
        lr_scheduler_type="constant", max_grad_norm=1.0, use_cpu=True, dataloader_num_workers=0, seed=0,
        bf16=False, fp16=False, gradient_checkpointing=False, logging_steps=10_000, save_strategy="no",
        report_to=[], disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=load_trl_model(model_dir), reward_funcs=[addition_reward], args=config,
        train_dataset=datasets.Dataset.from_list(rows), processing_class=tok, callbacks=[StepTimer()],
    )
    silence_trainer(trainer)
    generate = trainer._generate_single_turn  # timed, not changed: generation is TRL's rollout

    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        completion_ids, logprobs = generate(*args, **kwargs)
        rollout["s"] += time.perf_counter() - t0
        rollout["tokens"] += sum(len(c) for c in completion_ids)
        return completion_ids, logprobs

    trainer._generate_single_turn = timed_generate
    trainer.train()
    return steps
