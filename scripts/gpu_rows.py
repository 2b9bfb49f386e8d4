"""bench_gpu.py's workloads as data, the same for every side it times (rltrain, the plain loop, TRL):
the model built locally with random weights, the synthetic rows, GRPO's fixed rollouts, how a
step's rows split into micro-batches, and the optimizer and loss settings all sides share. The
benchmark and its numbers: docs/benchmarks.md and docs/gpus.md.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

SHAPES = {
    "qwen0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                     num_attention_heads=14, num_key_value_heads=2),
    "small": dict(vocab_size=128, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                  num_attention_heads=12, num_key_value_heads=4),
}
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +=-"
LR, DPO_BETA, CLIP_LOW, CLIP_HIGH, MAX_COMPLETION = 1e-5, 0.1, 0.2, 0.28, 600


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
