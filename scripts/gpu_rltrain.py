"""bench_gpu.py's rltrain side: a workload's optimizer steps on rltrain's engine (FSDP, or megatron
at tp = pp = 1) over fixed micro-batches, and the model FLOPs each step counts for MFU (the formula
is in bench_gpu.py's docstring). scripts/bench_lora.py runs the same workloads with LoRA adapters.
The benchmark and its numbers: docs/benchmarks.md and docs/gpus.md.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from bench_common import cuda_sync
from gpu_rows import (
    CLIP_HIGH,
    CLIP_LOW,
    DPO_BETA,
    LR,
    encode,
    fixed_rollouts,
    max_completion,
    micro_indices,
    sft_rows,
    total_steps,
)


class Workload:
    """One algorithm's optimizer steps on fixed batches: `step(k)` -> (seconds, model FLOPs, tokens)."""

    def __init__(
        self, name: str, model_dir: Path, rows: list[dict[str, str]], args, device: torch.device, adapters=None,
        gradient_checkpointing: bool = False, backend_name: str = "fsdp", optim_implementation: str = "auto",
        shared=None,
    ) -> None:
        """`adapters`: a LoraAdapterConfig to train LoRA adapters (scripts/bench_lora.py); DPO's
        reference is then the policy's base with the adapters off, as in a run. `backend_name`:
        fsdp or megatron (tp = pp = 1), with the same rows, micro-batches, loss and optimizer.
        `optim_implementation`: `optim.implementation`, AdamW's kernels. `shared`: the process's
        SharedObjects (rltrain.config.run_context), so successive megatron workloads join one
        parallel state, as a run's engines do."""
        from transformers import AutoConfig

        from rltrain.backends.fsdp.engine import FSDPEngine
        from rltrain.config.group_options import FSDPBackendConfig
        from rltrain.config.schema import OptimConfig
        from rltrain.models.tokenizer import load_tokenizer

        self.name, self.args, self.device = name, args, device
        self.tok = load_tokenizer(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        matmul_params = count_matmul_params(config)
        self.flops_per_param_token = 6 * matmul_params
        self.attn_flops_per_len = 6 * config.num_hidden_layers * config.hidden_size
        optim = OptimConfig(lr=LR, warmup_steps=0, schedule="constant", beta2=0.999, max_grad_norm=1.0,
                            implementation=optim_implementation)
        total = total_steps(args)
        self.reference = None
        if backend_name == "megatron":
            from rltrain.backends.megatron.engine import MegatronEngine
            from rltrain.config.group_options import MegatronBackendConfig
            from rltrain.config.run_context import SharedObjects

            megatron = MegatronBackendConfig()
            shared = shared if shared is not None else SharedObjects()
            self.policy = MegatronEngine(model_dir, megatron, optim, total, device, precision=args.precision,
                                         gradient_checkpointing=gradient_checkpointing, shared=shared)
            if name == "dpo":
                self.reference = MegatronEngine(model_dir, megatron, None, total, device, precision=args.precision,
                                                shared=shared)
        else:
            backend = FSDPBackendConfig(
                padding_free=args.padding_free, compile=args.compile, share_prompts=not args.no_share_prompts
            )
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
            from rltrain.algos.rl.update import PolicyBatchInputs
            from rltrain.data.ragged import Ragged

            rollouts = fixed_rollouts(self.tok, rows, k, a.batch, a.group, a.row_length)
            prompts, completions = rollouts.prompts, rollouts.completions
            batch = SequenceBatch.from_lists(prompts, completions)
            # On-policy from the training pass (old/entropy/reference None); the engine's log-probabilities
            # are not measured here (no rollout engine), so zeros stand in and no correction reads them.
            no_engine_logps = Ragged.from_lengths(torch.zeros(batch.num_completion_tokens, device="cpu"), batch.completion_lens())
            batch.loss_inputs = PolicyBatchInputs(
                adv=torch.tensor(rollouts.adv_B, device="cpu"), engine_logps=no_engine_logps,
                global_tokens=float(sum(map(len, completions))), global_seqs=float(len(completions)),
            )
        return [batch.select(idx) for idx in micro_indices(prompts, completions, a)]

    def _loss(self):
        from types import SimpleNamespace

        from rltrain.algos.dpo import make_dpo_loss
        from rltrain.algos.rl.update import make_policy_loss
        from rltrain.algos.sft import sft_loss

        if self.name == "sft":
            return sft_loss
        if self.name == "dpo":
            return make_dpo_loss(DPO_BETA, "sigmoid", 0.0, 0.0)
        cfg = SimpleNamespace(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, beta=0.0, loss_agg="token_mean",
                              importance_level="token", policy_loss="clip", max_new_tokens=max_completion(self.args),
                              rollout_correction="none", rollout_is_cap=2.0, rollout_mask_band=2.0, rollout_is_floor=0.0,
                              rollout_geo_band=[0.999, 1.001], rollout_icepop_band=[0.5, 5.0])
        return make_policy_loss(cfg)

    def step(self, k: int) -> tuple[float, float, int]:
        from rltrain.algos.dpo import attach_reference

        micro = self.steps[k]
        seqs = [len(s) for mb in micro for s in mb.tokens.split()]
        tokens = sum(seqs)  # what TRL counts: a shared prompt once per sequence
        mean_len = sum(n * n for n in seqs) / max(tokens, 1)  # token-weighted: what attention sees
        flops = count_model_tokens(micro) * (self.flops_per_param_token + self.attn_flops_per_len * mean_len)
        cuda_sync(self.device)
        t0 = time.perf_counter()
        if self.reference is not None:
            attach_reference(micro, self.reference)
            flops += flops / 3  # the reference's forward over the same tokens
        self.policy.train_step(micro, self._loss())
        cuda_sync(self.device)
        return time.perf_counter() - t0, flops, tokens


def count_model_tokens(micro) -> int:
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


def count_matmul_params(config) -> int:
    """Parameters that take part in a matmul per token: every decoder weight plus the output head
    (the input embedding is a lookup)."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = h // config.num_attention_heads * config.num_key_value_heads
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i
    return layers * per_layer + config.vocab_size * h
