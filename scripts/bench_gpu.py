"""Training throughput on one device: SFT, DPO and GRPO's update, with tokens/s, MFU and peak memory.

    .venv/bin/python scripts/bench_gpu.py                       # CUDA: the 0.494B Qwen2 shape, bf16-mixed
    .venv/bin/python scripts/bench_gpu.py --model small         # any device: a small model (CPU: fp32)
    .venv/bin/python scripts/bench_gpu.py --only sft --steps 10 --warmup 3
    .venv/bin/python scripts/bench_gpu.py --compile             # decoder layers torch.compile'd (backend.compile)

The model is built locally with random weights (no download): `--model qwen0.5b` is Qwen2.5-0.5B's
shape (hidden 896, 24 layers, 14 query / 2 KV heads, intermediate 4864, vocabulary 151,936, tied
embeddings), `--model small` a ~10M-parameter one. The tokenizer is the character tokenizer of the
embedded default, and the data synthetic rows of 50-400 prompt + 50-600 completion characters
(~530 tokens on average), `--batch` rows per optimizer step in micro-batches of `--micro`.

What each row times (one optimizer step, after `--warmup` untimed ones):
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

With TRL importable (`pip install trl==1.16.0`), TRL's `SFTTrainer` runs on the same rows, model
and batch (bf16 autocast on CUDA, fp32 on CPU) and its tokens/s and peak memory are printed beside
ours. DPO and GRPO are measured for rltrain only: TRL's side of those is not wired here yet.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from bench_common import init_single_rank, print_table, quiet_transformers, trl_available

SHAPES = {
    "qwen0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                     num_attention_heads=14, num_key_value_heads=2),
    "small": dict(vocab_size=128, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                  num_attention_heads=12, num_key_value_heads=4),
}
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +=-"


def build_model_dir(shape: str, directory: Path, device: torch.device) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rltrain.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        **SHAPES[shape], max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def make_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(lo, hi)))

    return [{"prompt": text(50, 400), "completion": text(50, 600), "rejected": text(50, 600)} for _ in range(n)]


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


class Workload:
    """One algorithm's optimizer steps on fixed batches: `step(k)` -> (seconds, model FLOPs, tokens)."""

    def __init__(self, name: str, model_dir: Path, rows: list[dict[str, str]], args, device: torch.device) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from rltrain.backends.fsdp import FSDPEngine
        from rltrain.config import FSDPBackendConfig, OptimConfig

        self.name, self.args, self.device = name, args, device
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        matmul_params = _matmul_params(config)
        self.flops_per_param_token = 6 * matmul_params
        self.attn_flops_per_len = 6 * config.num_hidden_layers * config.hidden_size
        optim = OptimConfig(lr=1e-5, warmup_steps=0, schedule="constant", beta2=0.999, max_grad_norm=1.0)
        total = args.steps + args.warmup
        backend = FSDPBackendConfig(padding_free=args.padding_free, compile=args.compile)
        self.policy = FSDPEngine(model_dir, backend, optim, total, device, precision=args.precision)
        self.reference = None
        if name == "dpo":
            self.reference = FSDPEngine(model_dir, backend, None, total, device, precision=args.precision)
        self.steps = [self._build(rows, k) for k in range(total)]

    def _enc(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _build(self, rows: list[dict[str, str]], k: int):
        from rltrain.algos.dpo import dpo_micro_batches
        from rltrain.data.batch import SequenceBatch
        from rltrain.data.preference_data import PreferencePair

        a, eos = self.args, self.tok.eos_token_id
        chunk = rows[k * a.batch : (k + 1) * a.batch]
        if self.name == "dpo":
            pairs = [PreferencePair(self._enc(r["prompt"]), self._enc(r["completion"]) + [eos],
                                    self._enc(r["rejected"]) + [eos]) for r in chunk]
            micro, _ = dpo_micro_batches(pairs, 0, 1, a.micro)
            return micro
        if self.name == "sft":
            prompts = [self._enc(r["prompt"]) for r in chunk]
            completions = [self._enc(r["completion"]) + [eos] for r in chunk]
            extras = {"global_tokens": float(sum(map(len, completions)))}
        else:  # grpo: chunk // group prompts, each with `group` completions of random tokens
            rng = random.Random(k)
            prompts, completions = [], []
            for r in chunk[: max(1, a.batch // a.group)]:
                ids = self._enc(r["prompt"])
                for _ in range(a.group):
                    prompts.append(ids)
                    completions.append([rng.randrange(3, len(self.tok)) for _ in range(rng.randint(50, 600))])
            n = sum(map(len, completions))
            adv = torch.tensor([rng.uniform(-1, 1) for _ in completions], device="cpu")
            extras = {"global_tokens": float(n), "global_seqs": float(len(completions)), "adv": adv,
                      "old_logps": None, "entropy": None, "ref_logps": None, "engine_logps": None,
                      "measure_parity": False}
        batch = SequenceBatch.from_lists(prompts, completions, **extras)
        return [batch.select(list(range(i, min(i + a.micro, len(batch))))) for i in range(0, len(batch), a.micro)]

    def _loss(self):
        from types import SimpleNamespace

        from rltrain.algos.dpo import make_dpo_loss
        from rltrain.algos.rl_update import make_policy_loss
        from rltrain.algos.sft import sft_loss

        if self.name == "sft":
            return sft_loss
        if self.name == "dpo":
            return make_dpo_loss(0.1, "sigmoid", 0.0, 0.0)
        cfg = SimpleNamespace(clip_low=0.2, clip_high=0.28, beta=0.0, loss_agg="token_mean", max_new_tokens=600,
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


def run_ours(name: str, model_dir: Path, rows, args, device: torch.device) -> dict:
    workload = Workload(name, model_dir, rows, args, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timings = [workload.step(k) for k in range(args.steps + args.warmup)][args.warmup :]
    seconds = sum(t for t, _, _ in timings)
    out = {
        "tokens/s": sum(n for _, _, n in timings) / seconds,
        "flops/s": sum(f for _, f, _ in timings) / seconds,
        "peak GiB": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }
    del workload
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run_trl_sft(model_dir: Path, rows, args, device: torch.device, out_dir: Path) -> dict:
    """TRL's SFTTrainer on the same rows, batch and micro-batch (bf16 autocast on CUDA)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    total = args.steps + args.warmup
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            _sync(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            _sync(device)
            times.append(time.perf_counter() - self.t0)

    config = SFTConfig(
        output_dir=str(out_dir), per_device_train_batch_size=args.micro, gradient_accumulation_steps=args.batch // args.micro,
        max_steps=total, learning_rate=1e-5, lr_scheduler_type="constant", logging_steps=10**6, save_strategy="no",
        report_to=[], bf16=device.type == "cuda", completion_only_loss=True, max_length=2048, dataloader_drop_last=True,
        use_cpu=device.type != "cuda", disable_tqdm=True, seed=0,
    )
    ds = Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in rows[: total * args.batch]])
    trainer = SFTTrainer(model=model, args=config, train_dataset=ds, processing_class=tok, callbacks=[Timer()])
    lengths = [len(ids) for ids in trainer.train_dataset["input_ids"]]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    timed = times[args.warmup :]
    tokens = sum(lengths[args.warmup * args.batch : total * args.batch])
    return {
        "tokens/s": tokens / sum(timed),
        "peak GiB": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default=None, help="default: qwen0.5b on CUDA, small on CPU")
    parser.add_argument("--precision", default="auto", help="trainer.precision (auto: bf16-mixed on CUDA, fp32 on CPU)")
    parser.add_argument("--only", default="sft,dpo,grpo", help="comma-separated subset of sft,dpo,grpo")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per workload")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=32, help="rows (pairs for DPO, sequences for GRPO) per step")
    parser.add_argument("--micro", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--group", type=int, default=8, help="GRPO: completions per prompt")
    parser.add_argument("--no-trl", action="store_true", help="skip TRL even when importable")
    parser.add_argument("--padding-free", action="store_true", help="rltrain's rows with backend.padding_free=true")
    parser.add_argument("--port", type=int, default=29541)
    parser.add_argument("--compile", action="store_true", help="backend.compile=true: torch.compile each decoder layer")
    args = parser.parse_args()
    from rltrain.precision import resolve_precision

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = args.model or ("qwen0.5b" if device.type == "cuda" else "small")
    precision = resolve_precision(args.precision, device)
    quiet_transformers()
    init_single_rank(args.port)
    peak = matmul_peak_flops(device, precision.compute_dtype)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(shape, Path(tmp) / "model", device)
        rows = make_rows((args.steps + args.warmup) * args.batch)
        table = []
        for name in args.only.split(","):
            ours = run_ours(name, model_dir, rows, args, device)
            mem = f"{ours['peak GiB']:.1f}" if ours["peak GiB"] is not None else "-"
            row = [f"rltrain {name}", f"{ours['tokens/s']:.0f}", f"{100 * ours['flops/s'] / peak:.1f}%", mem, "-"]
            if name == "sft" and not args.no_trl and trl_available():
                theirs = run_trl_sft(model_dir, rows, args, device, Path(tmp) / "trl")
                row[-1] = f"{ours['tokens/s'] / theirs['tokens/s']:.2f}x"
                tmem = f"{theirs['peak GiB']:.1f}" if theirs["peak GiB"] is not None else "-"
                table.append(row)
                row = ["TRL 1.16 SFTTrainer", f"{theirs['tokens/s']:.0f}", "-", tmem, "1.00x"]
            table.append(row)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print_table(
        f"{shape} ({device_name}, {precision.name}{', padding-free' if args.padding_free else ''}"
        f"{', torch.compile per layer' if args.compile else ''}), "
        f"{args.batch} rows/step in micro-batches of {args.micro}, "
        f"{args.steps} timed steps (+{args.warmup} warm-up)",
        ["workload", "tokens/s", "MFU", "peak GiB", "vs TRL"],
        table,
        [f"matmul peak measured here: {peak / 1e12:.1f} TFLOP/s ({precision.compute_dtype_name})",
         "TRL: not importable or --no-trl" if args.no_trl or not trl_available() else "TRL: SFT only (DPO/GRPO sides not wired)"],
    )


if __name__ == "__main__":
    main()
