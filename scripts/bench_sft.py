"""SFT throughput: rltrain's FSDP engine vs TRL's SFTTrainer on the same model, data and batch.

Model: ~10M parameters shaped like the tiny default (Qwen2, hidden 384, 6 layers, head size 32),
built locally. Data: prompt/completion rows of 30-250 tokens. Both sides train with the same
global batch, no packing, completion-only loss, fp32, on CPU; the table reports tokens/s (prompt +
completion tokens processed per second) and step time after warm-up steps.

    .venv/bin/python scripts/bench_sft.py [--steps 8] [--batch 16]
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def bench_model_dir(cache: Path) -> Path:
    from rltrain.config import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(
        hidden_size=384, num_layers=6, num_heads=12, num_kv_heads=4, intermediate_size=1024,
        tie_word_embeddings=True, cache_dir=str(cache),
    )
    return build_tiny_model_dir(cfg, seed=0)


def make_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 +=-"
    rows = []
    for _ in range(n):
        total = rng.randint(30, 250)
        prompt_len = rng.randint(5, total // 2)
        text = "".join(rng.choice(alphabet) for _ in range(total - 1))
        rows.append({"prompt": text[:prompt_len], "completion": text[prompt_len:]})
    return rows


def bench_rltrain(model_dir: Path, rows: list[dict], batch: int, steps: int, warmup: int) -> list[tuple[float, int]]:
    from transformers import AutoTokenizer

    from rltrain.algos.sft import sft_loss
    from rltrain.backends.fsdp import FSDPEngine
    from rltrain.config import FSDPBackendConfig, OptimConfig
    from rltrain.data.batch import SequenceBatch

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = FSDPEngine(model_dir, FSDPBackendConfig(), OptimConfig(lr=1e-4, warmup_steps=0), steps + warmup, torch.device("cpu"))
    results = []
    for step in range(steps + warmup):
        chunk = rows[step * batch : (step + 1) * batch]
        prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in chunk]
        completions = [tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in chunk]
        n_tokens = sum(len(p) + len(c) for p, c in zip(prompts, completions))
        mb = SequenceBatch.from_lists(prompts, completions, global_tokens=float(sum(len(c) for c in completions)))
        t0 = time.perf_counter()
        engine.train_step([mb], sft_loss)
        if step >= warmup:
            results.append((time.perf_counter() - t0, n_tokens))
    return results


def bench_trl(model_dir: Path, rows: list[dict], batch: int, steps: int, warmup: int, out_dir: Path) -> list[tuple[float, int]]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ds = datasets.Dataset.from_list(rows[: (steps + warmup) * batch])
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    config = SFTConfig(
        output_dir=str(out_dir), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        max_steps=steps + warmup, learning_rate=1e-4, logging_steps=10_000, save_strategy="no", report_to=[],
        completion_only_loss=True, packing=False, max_length=512, use_cpu=True, dataloader_num_workers=0,
        lr_scheduler_type="constant", seed=0, bf16=False, fp16=False, eos_token=tok.eos_token, pad_token=tok.pad_token,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=ds, processing_class=tok, callbacks=[Timer()])
    trainer.train()
    token_counts = []
    for step in range(steps + warmup):
        chunk = rows[step * batch : (step + 1) * batch]
        token_counts.append(sum(len(r["prompt"]) + len(r["completion"]) + 1 for r in chunk))
    # TRL shuffles, but every batch is drawn from the same rows: use the mean batch size in tokens.
    mean_tokens = int(statistics.mean(token_counts))
    return [(t, mean_tokens) for t in times[warmup:]]


def summarise(name: str, results: list[tuple[float, int]]) -> tuple[float, float]:
    total_t = sum(t for t, _ in results)
    total_tok = sum(n for _, n in results)
    return total_tok / total_t, statistics.median(t for t, _ in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=600))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_model_dir(Path(tmp) / "cache")
        n_params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(model_dir).parameters())
        rows = make_rows((args.steps + args.warmup) * args.batch)
        table = [("rltrain (FSDP engine)", *summarise("rltrain", bench_rltrain(model_dir, rows, args.batch, args.steps, args.warmup)))]
        try:
            import trl  # noqa: F401

            table.append(("TRL SFTTrainer", *summarise("trl", bench_trl(model_dir, rows, args.batch, args.steps, args.warmup, Path(tmp) / "trl"))))
        except ImportError:
            print("TRL is not importable: install trl==1.16.0 to compare")
    print(f"\nSFT, {n_params / 1e6:.1f}M params, batch {args.batch} sequences of 30-250 tokens, {args.threads} threads, CPU fp32")
    print(f"{'system':<24}{'tokens/s':>12}{'step s (median)':>18}")
    for name, tps, step_s in table:
        print(f"{name:<24}{tps:>12.0f}{step_s:>18.3f}")
    if len(table) == 2:
        print(f"rltrain / TRL tokens/s: {table[0][1] / table[1][1]:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
