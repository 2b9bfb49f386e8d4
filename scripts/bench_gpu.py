"""Training throughput on one device: SFT, DPO and GRPO's update, with tokens/s, MFU and peak memory.

    .venv/bin/python scripts/bench_gpu.py                       # CUDA: the 0.494B Qwen2 shape, bf16-mixed
    .venv/bin/python scripts/bench_gpu.py --model small         # any device: a small model (CPU: fp32)
    .venv/bin/python scripts/bench_gpu.py --only sft --steps 10 --warmup 3
    .venv/bin/python scripts/bench_gpu.py --compile             # decoder layers torch.compile'd (backend.compile)
    .venv/bin/python scripts/bench_gpu.py --padding-free --max-tokens 16384   # one packed row per ~16k tokens
    .venv/bin/python scripts/bench_gpu.py --rows dense --batch 8 --micro 8 --backend fsdp,megatron --profile prof/
    PYTHONPATH=<trl dir> .venv/bin/python scripts/bench_gpu.py --model small --steps 2 --warmup 1 --batch 8 --micro 4 --threads 1

The model is built locally with random weights (no download): `--model qwen0.5b` is Qwen2.5-0.5B's
shape (hidden 896, 24 layers, 14 query / 2 KV heads, intermediate 4864, vocabulary 151,936, tied
embeddings), `--model small` a ~10M-parameter one. The tokenizer is the character tokenizer of the
embedded default, and the data synthetic rows of 50-400 prompt + 50-600 completion characters
(~530 tokens on average), or with `--rows dense` every sequence exactly `--length` tokens (default
2048, a quarter of them prompt; `--rows dense --batch 8 --micro 8` is 8 x 2048 per step and per
micro-batch), `--batch` rows per optimizer step in micro-batches of `--micro`; with
`--max-tokens N` rltrain's micro-batches are filled in order up to N tokens instead
(`trainer.max_tokens_per_micro_batch`; with `--padding-free` each is one packed row), while TRL
keeps `--micro` rows. The loss and the optimizer step are the same either way (losses are
normalised by the step's counts), only memory and speed change.

What each row times (one optimizer step, after `--warmup` untimed ones; rltrain's rows on FSDP, or
with `--backend fsdp,megatron` on both backends, megatron at tp = pp = 1, labelled "(megatron)"):
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

With TRL importable (docs/benchmarks.md: installed beside the venv; `--no-trl` skips it), TRL 1.16 runs each workload
on the same model, rows, `--batch` and `--micro` (its `per_device_train_batch_size` = `--micro`,
gradient accumulation = `--batch / --micro`), the same optimizer settings (AdamW, lr 1e-5
constant, clipping at 1.0), bf16 autocast over fp32 weights where ours is `bf16-mixed` (fp32 on
CPU), activations kept on both sides (TRL's configs default to recomputing them: turned off), and
its row is printed under ours with the same columns. Its step is timed from its
`on_step_begin` to its `on_step_end` callback (the step's micro-batches are already loaded and
collated; the forwards, backwards, clipping, AdamW step and zero_grad are inside), CUDA-synchronised
at both ends:
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
import gc
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_common import (
    dpo_pair_tokens,
    init_single_rank,
    load_trl_model,
    per_step,
    print_table,
    quiet_transformers,
    sft_row_tokens,
    silence_trainer,
    trl_args,
    trl_available,
    trl_dpo_trainer,
    trl_sft_trainer,
    trl_step_timer,
)

SHAPES = {
    "qwen0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                     num_attention_heads=14, num_key_value_heads=2),
    "small": dict(vocab_size=128, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                  num_attention_heads=12, num_key_value_heads=4),
}
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +=-"
LR, DPO_BETA, CLIP_LOW, CLIP_HIGH, MAX_COMPLETION = 1e-5, 0.1, 0.2, 0.28, 600
TRL_NAMES = {"sft": "SFTTrainer", "dpo": "DPOTrainer", "grpo": "GRPOTrainer update"}
WORKLOADS = ("plain", "sft", "dpo", "grpo")


def build_model_dir(shape: str, directory: Path, device: torch.device, max_positions: int = 2048) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rltrain.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        **SHAPES[shape], max_position_embeddings=max_positions, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def make_rows(n: int, seed: int = 0, length: int = 0) -> list[dict[str, str]]:
    """`n` rows of characters (one token each): mixed lengths, or with `length` > 0 (`--rows dense`)
    every sequence exactly `length` tokens with its EOS, a quarter of them prompt."""
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(lo, hi)))

    if length:
        p, c = length // 4, length - length // 4 - 1
        return [{"prompt": text(p, p), "completion": text(c, c), "rejected": text(c, c)} for _ in range(n)]
    return [{"prompt": text(50, 400), "completion": text(50, 600), "rejected": text(50, 600)} for _ in range(n)]


def total_steps(args) -> int:
    """Optimizer steps each workload runs: warm-up, timed, and with --profile one more, profiled."""
    return args.warmup + args.steps + (1 if args.profile else 0)


def max_completion(args) -> int:
    """The longest GRPO completion: dense rows' fixed length, else the mixed rows' cap."""
    return args.row_length - args.row_length // 4 if args.row_length else MAX_COMPLETION


def matmul_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Best FLOP/s of a square matmul on this device and dtype."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5 if device.type == "cuda" else 3):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(10 if device.type == "cuda" else 1):
            a @ b
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / (10 if device.type == "cuda" else 1))
    return 2 * n**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def grpo_sequences(batch: int, group: int) -> int:
    """Sequences of one GRPO step: `batch // group` prompts (at least one) x `group` completions."""
    return max(1, batch // group) * group


@dataclass(frozen=True)
class FixedRollouts:
    """One GRPO step's experience, the same for both sides: each prompt once per completion of its
    group, completions of random tokens, one advantage per completion."""

    prompts: list[list[int]]
    completions: list[list[int]]
    adv_B: list[float]


def fixed_rollouts(tok, rows: list[dict[str, str]], k: int, batch: int, group: int, length: int = 0) -> FixedRollouts:
    """`length` > 0 (dense rows): every prompt + completion exactly `length` tokens."""
    rng = random.Random(k)
    prompts, completions = [], []
    for r in rows[k * batch : (k + 1) * batch][: grpo_sequences(batch, group) // group]:
        ids = encode(tok, r["prompt"])
        for _ in range(group):
            prompts.append(ids)
            size = length - len(ids) if length else rng.randint(50, MAX_COMPLETION)
            completions.append([rng.randrange(3, len(tok)) for _ in range(size)])
    return FixedRollouts(prompts, completions, [rng.uniform(-1, 1) for _ in completions])


class Workload:
    """One algorithm's optimizer steps on fixed batches: `step(k)` -> (seconds, model FLOPs, tokens)."""

    def __init__(
        self, name: str, model_dir: Path, rows: list[dict[str, str]], args, device: torch.device, adapters=None,
        gradient_checkpointing: bool = False, backend_name: str = "fsdp",
    ) -> None:
        """`adapters`: a LoraAdapterConfig to train LoRA adapters (scripts/bench_lora.py); DPO's
        reference is then the policy's base with the adapters off, as in a run. `backend_name`:
        fsdp or megatron (tp = pp = 1), with the same rows, micro-batches, loss and optimizer."""
        from transformers import AutoConfig

        from rltrain.backends.fsdp.engine import FSDPEngine
        from rltrain.config.group_options import FSDPBackendConfig
        from rltrain.config.schema import OptimConfig
        from rltrain.models.tokenizer import load_tokenizer

        self.name, self.args, self.device = name, args, device
        self.tok = load_tokenizer(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        matmul_params = _matmul_params(config)
        self.flops_per_param_token = 6 * matmul_params
        self.attn_flops_per_len = 6 * config.num_hidden_layers * config.hidden_size
        optim = OptimConfig(lr=LR, warmup_steps=0, schedule="constant", beta2=0.999, max_grad_norm=1.0)
        total = total_steps(args)
        self.reference = None
        if backend_name == "megatron":
            from rltrain.backends.megatron.engine import MegatronEngine
            from rltrain.config.group_options import MegatronBackendConfig

            megatron = MegatronBackendConfig()
            self.policy = MegatronEngine(model_dir, megatron, optim, total, device, precision=args.precision,
                                         gradient_checkpointing=gradient_checkpointing)
            if name == "dpo":
                self.reference = MegatronEngine(model_dir, megatron, None, total, device, precision=args.precision)
        else:
            backend = FSDPBackendConfig(padding_free=args.padding_free, compile=args.compile)
            self.policy = FSDPEngine(
                model_dir, backend, optim, total, device, precision=args.precision, adapters=adapters,
                gradient_checkpointing=gradient_checkpointing,
            )
            if name == "dpo":
                self.reference = self.policy.base_weights() or FSDPEngine(
                    model_dir, backend, None, total, device, precision=args.precision
                )
        self.steps = [self._build(rows, k) for k in range(total)]

    def _build(self, rows: list[dict[str, str]], k: int):
        from rltrain.algos.dpo import dpo_micro_batches
        from rltrain.data.batch import SequenceBatch
        from rltrain.data.preference_data import PreferencePair

        a, eos = self.args, self.tok.eos_token_id
        chunk = rows[k * a.batch : (k + 1) * a.batch]
        # --max-tokens: rltrain's micro-batches by token budget (trainer.max_tokens_per_micro_batch),
        # any number of rows; TRL keeps --micro rows
        rows_per_micro = a.batch if a.max_tokens else a.micro
        if self.name == "dpo":
            pairs = [PreferencePair(encode(self.tok, r["prompt"]), encode(self.tok, r["completion"]) + [eos],
                                    encode(self.tok, r["rejected"]) + [eos]) for r in chunk]
            micro, _ = dpo_micro_batches(pairs, 0, 1, rows_per_micro, a.max_tokens)
            return micro
        if self.name == "sft":
            prompts, completions = sft_rows(self.tok, rows, k, a.batch)
            batch = SequenceBatch.from_lists(prompts, completions, global_tokens=float(sum(map(len, completions))))
        else:
            from rltrain.algos.rl_update import PolicyLossInputs
            from rltrain.data.ragged import Ragged

            rollouts = fixed_rollouts(self.tok, rows, k, a.batch, a.group, a.row_length)
            prompts, completions = rollouts.prompts, rollouts.completions
            batch = SequenceBatch.from_lists(prompts, completions)
            # On-policy from the training pass (old/entropy/reference None); the engine's log-probabilities
            # are not measured here (no rollout engine), so zeros stand in and no correction reads them.
            no_engine_logps = Ragged.from_lengths(torch.zeros(batch.num_completion_tokens, device="cpu"), batch.completion_lens())
            batch.loss_inputs = PolicyLossInputs(
                adv=torch.tensor(rollouts.adv_B, device="cpu"), engine_logps=no_engine_logps,
                global_tokens=float(sum(map(len, completions))), global_seqs=float(len(completions)),
            )
        return [batch.select(idx) for idx in micro_indices(prompts, completions, a)]

    def _loss(self):
        from types import SimpleNamespace

        from rltrain.algos.dpo import make_dpo_loss
        from rltrain.algos.losses import sft_loss
        from rltrain.algos.rl_update import make_policy_loss

        if self.name == "sft":
            return sft_loss
        if self.name == "dpo":
            return make_dpo_loss(DPO_BETA, "sigmoid", 0.0, 0.0)
        cfg = SimpleNamespace(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, beta=0.0, loss_agg="token_mean",
                              importance_level="token", policy_loss="clip", max_new_tokens=max_completion(self.args),
                              rollout_correction="none", rollout_is_cap=2.0, rollout_mask_band=2.0)
        return make_policy_loss(cfg)

    def step(self, k: int) -> tuple[float, float, int]:
        from rltrain.algos.dpo import attach_reference

        micro = self.steps[k]
        seqs = [len(s) for mb in micro for s in mb.tokens.split()]
        tokens = sum(seqs)  # what TRL counts: a shared prompt once per sequence
        mean_len = sum(n * n for n in seqs) / max(tokens, 1)  # token-weighted: what attention sees
        flops = _model_tokens(micro) * (self.flops_per_param_token + self.attn_flops_per_len * mean_len)
        _sync(self.device)
        t0 = time.perf_counter()
        if self.reference is not None:
            attach_reference(micro, self.reference)
            flops += flops / 3  # the reference's forward over the same tokens
        self.policy.train_step(micro, self._loss())
        _sync(self.device)
        return time.perf_counter() - t0, flops, tokens


def sft_rows(tok, rows: list[dict[str, str]], k: int, batch: int) -> tuple[list[list[int]], list[list[int]]]:
    """SFT step k's prompts and completions (with EOS), as token ids."""
    chunk = rows[k * batch : (k + 1) * batch]
    return [encode(tok, r["prompt"]) for r in chunk], [encode(tok, r["completion"]) + [tok.eos_token_id] for r in chunk]


def micro_indices(prompts: list[list[int]], completions: list[list[int]], args) -> list[list[int]]:
    """The rows of each micro-batch, as rltrain splits a step: `--micro` rows, or with
    `--max-tokens` rows in order up to the token budget (trainer.max_tokens_per_micro_batch)."""
    from rltrain.data.sharding import micro_batch_count, split_micro_batches

    rows_per_micro = len(prompts) if args.max_tokens else args.micro
    sizes = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    count = micro_batch_count(len(prompts), 1, rows_per_micro)
    return [idx for idx in split_micro_batches(list(range(len(prompts))), count, rows_per_micro, sizes, args.max_tokens) if idx]


def _model_tokens(micro) -> int:
    """Tokens the model must process: a prompt shared by several sequences of a micro-batch (a DPO
    pair, a GRPO group) once, since computing it again is work saved, not work done."""
    total = 0
    for mb in micro:
        prompts = set()
        for seq, prompt_len in zip(mb.tokens.split(), mb.prompt_lens.tolist()):
            total += len(seq) - prompt_len
            prompts.add(tuple(seq[:prompt_len].tolist()))
        total += sum(map(len, prompts))
    return total


def _matmul_params(config) -> int:
    """Parameters that take part in a matmul per token: every decoder weight plus the output head
    (the input embedding is a lookup)."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = h // config.num_attention_heads * config.num_key_value_heads
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i
    return layers * per_layer + config.vocab_size * h


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def _release(device: torch.device) -> None:
    """Free the last workload before the next one, so its memory is not in the next peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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


def run_ours(name: str, model_dir: Path, rows, args, device: torch.device, backend_name: str = "fsdp") -> dict:
    workload = Workload(name, model_dir, rows, args, device, backend_name=backend_name)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timings = _timed_steps(workload.step, args, ours_label(name, backend_name), device)
    seconds = sum(t for t, _, _ in timings)
    out = {
        "tokens/s": sum(n for _, _, n in timings) / seconds,
        "flops/s": sum(f for _, f, _ in timings) / seconds,
        "step tokens": [n for _, _, n in timings],
        "peak GiB": _peak_gib(device),
    }
    if backend_name == "megatron":  # megatron's shared parallel state keeps its engines' models for re-binding
        workload.policy.groups.detach(*[e.model for e in [workload.policy, workload.reference] if e is not None])
    del workload
    _release(device)
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
        flops.append(sum(seqs) * (6 * _matmul_params(config) + 6 * config.num_hidden_layers * config.hidden_size * mean_len))
        tokens.append(sum(seqs))
    out = {"tokens/s": sum(tokens) / sum(seconds), "flops/s": sum(flops) / sum(seconds), "step tokens": tokens,
           "peak GiB": _peak_gib(device)}
    del loop
    _release(device)
    return out


def _unused_reward(**_) -> list[float]:
    """GRPOTrainer needs a reward function; the update benchmark bypasses scoring, so never called."""
    raise AssertionError("the GRPO update benchmark scores nothing: its rollouts come with advantages")


def trl_grpo_update_trainer(model_dir: Path, rows, args, trainer_args: dict, dtype: torch.dtype, callback):
    """TRL's GRPOTrainer whose generation and scoring return our fixed rollouts (see the module
    docstring); (trainer, tokens of each sequence in step order)."""
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
    """TRL 1.16's trainer for workload `name` on the same rows, batch and micro-batch (module docstring);
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
        "peak GiB": _peak_gib(device),
    }
    del trainer
    _release(device)
    return out


def check_batches(parser: argparse.ArgumentParser, args, names: list[str], with_trl: bool) -> None:
    """Bad workload names or batch shapes TRL cannot take stop here, before any model is built."""
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"--only {args.only}: unknown workload(s) {', '.join(unknown)}; choose from {','.join(WORKLOADS)}")
    bad_backends = sorted(set(args.backend.split(",")) - {"fsdp", "megatron"})
    if bad_backends:
        parser.error(f"--backend {args.backend}: unknown backend(s) {', '.join(bad_backends)}; choose from fsdp,megatron")
    if "megatron" in args.backend.split(",") and (args.padding_free or args.compile):
        parser.error("--padding-free and --compile are FSDP options (backend.padding_free, backend.compile); "
                     "pass --backend fsdp with them")
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


def main() -> None:
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
    args = parser.parse_args()
    args.row_length = args.length if args.rows == "dense" else 0
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
            results = {b: run_ours(name, model_dir, rows, args, device, b) for b in backends}
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
    notes.insert(0, f"matmul peak measured here: {peak / 1e12:.1f} TFLOP/s ({precision.compute_dtype_name})")
    notes.insert(1, "TRL 1.16: same rows, batch and micro-batch, run after ours (not interleaved); vs TRL = tokens/s ratio"
                 if with_trl else "TRL: not importable or --no-trl")
    if plain:
        notes.insert(2, f"vs plain = MFU / the MFU of the '{same_head}' row (the plain loop with rltrain's output head); "
                     "for sft (the same rows and micro-batches) also the tokens/s ratio")
    rows_text = f"dense rows of {args.length} tokens" if args.row_length else "mixed-length rows"
    print_table(
        f"{shape} ({device_name}, {precision.name}, rltrain on {args.backend}{', padding-free' if args.padding_free else ''}"
        f"{', torch.compile per layer' if args.compile else ''}), "
        f"{args.batch} {rows_text}/step in micro-batches of "
        f"{f'<= {args.max_tokens} tokens (TRL: {args.micro} rows)' if args.max_tokens else args.micro}, "
        f"{args.steps} timed steps (+{args.warmup} warm-up), {torch.get_num_threads()} CPU threads",
        ["workload", "tokens/s", "MFU", "peak GiB", "vs plain", "vs TRL"],
        table,
        notes,
    )


if __name__ == "__main__":
    main()
