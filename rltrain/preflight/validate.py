"""Checks across keys that a schema cannot express, run before any model is built.

Types and key names are already enforced by the structured config while Hydra composes; this
catches values that are well-typed but unusable, with a message naming the key and the fix.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from rltrain.config import group_options, schema
from rltrain.config.algorithms import SPECS, AlgoConfig, spec_of
from rltrain.config.choices import choices_of
from rltrain.config.group_options import VLLMRolloutConfig
from rltrain.config.schema import TINY_MOE_HEAD_DIM, Config, ModelConfig
from rltrain.data.tasks import NO_CODE_PAIRS, TASK_SIZES
from rltrain.preflight.compose_errors import added_keys
from rltrain.preflight.context_parallel import validate_context_parallel
from rltrain.preflight.reasoning_gym import validate_reasoning_gym
from rltrain.preflight.sources import (
    check_revision,
    validate_data_sources,
    validate_model_source,
)
from rltrain.preflight.trackers import validate_trackers
from rltrain.preflight.validate_eval import validate_eval
from rltrain.preflight.validate_inflight import validate_in_flight
from rltrain.preflight.validate_rl import (
    validate_env,
    validate_router_replay,
    validate_servers,
    validate_staleness,
)
from rltrain.preflight.validate_roles import validate_roles
from rltrain.preflight.world import data_parallel_size, validate_megatron_split
from rltrain.runtime.errors import UserError

# Every enum-like key of every group and the values it accepts (the schema's `Literal`s), checked
# before anything is built so a typo (`algo.loss_agg=tokenmean`) is one message naming the allowed
# values, not a failure mid-run. A key that exists for some options of its group only
# (`algo.loss` for algo=dpo, `rollout.process` for rollout=vllm) is checked where it exists.
SECTIONS: tuple[tuple[str, type], ...] = (
    ("trainer", schema.TrainerConfig), ("optim", schema.OptimConfig), ("model", schema.ModelConfig),
    ("data", schema.DataConfig), ("logger.wandb", schema.WandbConfig), ("sweep", schema.SweepConfig),
    *(("algo", spec.config) for spec in SPECS), ("rollout", group_options.VLLMRolloutConfig),
    ("rollout.servers", group_options.ServersConfig), ("reward.sandbox", schema.SandboxConfig),
    ("placement", schema.PlacementConfig), ("reward_model", group_options.JudgeRewardModelConfig),
)
CHOICES: dict[str, tuple[str, ...]] = {
    f"{prefix}.{name}": values for prefix, cls in SECTIONS for name, values in choices_of(cls).items()
}
CHOICE_HINTS = {
    "placement.weight_update": " (the engine loads a new version between batches, or between two decoding steps: docs/async.md)",
    "rollout.process": " (the vLLM engine in the trainer's process, or in a child process of its own)",
    "algo.rollout_correction": " (auto: none in sync and tis with placement.max_staleness >= 1; trust the samples, truncated importance weights per token, drop sequences whose train/rollout ratio leaves a band, or the sequence-level and masking variants: docs/algorithms.md#rollout-correction)",
    "rollout.servers.push_backend": " (auto: NCCL where the trainer and a server it did not spawn both run on CUDA, gloo otherwise)",
    "algo.loss_agg": " (DAPO's token mean, GRPO's mean of per-sequence means, Dr. GRPO's sums over the generation budget)",
}
_ABSENT = object()


def _get(cfg: Config, dotted: str, default=None):
    """`cfg.a.b`; `default` (when given) where a part is missing or a group is unset (rollout=null)."""
    node: Any = cfg
    for part in dotted.split("."):
        if default is not None and (node is None or part not in node):
            return default
        node = getattr(node, part)
    return node


def validate_choices(cfg: Config) -> None:
    for key, allowed in CHOICES.items():
        value = _get(cfg, key, _ABSENT)
        if value is not _ABSENT and value not in allowed:
            raise UserError(f"{key}={value!r} is not one of {', '.join(allowed)}{CHOICE_HINTS.get(key, '')}.")


def validate(cfg: Config) -> None:
    """Every check, in an order where the first failure is the one to fix first."""
    if added := added_keys(cfg):
        raise UserError(
            f"unknown config key(s) {', '.join(added)}: rltrain reads no such key, so the value would be ignored. "
            "Remove the leading '+' and the key's typo (`python -m rltrain --cfg job` prints every key)."
        )
    validate_choices(cfg)
    validate_trainer(cfg)
    validate_megatron_split(cfg)
    validate_context_parallel(cfg)
    validate_compile(cfg)
    validate_batch_and_logging(cfg)
    validate_trackers(cfg)
    validate_eval(cfg)
    validate_reward(cfg)
    validate_model(cfg.model)
    validate_lora(cfg)
    validate_data(cfg)
    validate_algo(cfg.algo)
    validate_roles(cfg)
    validate_env(cfg)
    validate_staleness(cfg)
    validate_router_replay(cfg)
    validate_in_flight(cfg)
    validate_servers(cfg)
    validate_safety(cfg)
    if cfg.rollout is not None and cfg.rollout.name == "vllm":
        validate_vllm(cfg.rollout)
    from rltrain.safety.faults import parse_faults

    parse_faults(cfg.debug.fault)  # a malformed debug.fault fails here, before any model is built
    validate_data_sources(cfg.data)


def validate_trainer(cfg: Config) -> None:
    positive = ["trainer.max_steps", "trainer.nproc", "trainer.global_batch_size", "trainer.micro_batch_size", "data.max_length"]
    for key in positive:
        if _get(cfg, key) < 1:
            raise UserError(f"{key}={_get(cfg, key)} must be at least 1.")
    if cfg.trainer.max_tokens_per_micro_batch < 0:
        raise UserError(
            f"trainer.max_tokens_per_micro_batch={cfg.trainer.max_tokens_per_micro_batch} must be 0 (no token budget) "
            "or a positive number of tokens."
        )
    if cfg.trainer.keep_checkpoints < 1:
        raise UserError(
            f"trainer.keep_checkpoints={cfg.trainer.keep_checkpoints} must be at least 1: it is how many of the "
            "newest checkpoints are kept, and the one just written is always among them. To save none, set "
            "trainer.save_every=0 (the last step is still saved for resume)."
        )


def validate_batch_and_logging(cfg: Config) -> None:
    # An algorithm that generates sizes its steps by algo.prompts_per_step instead.
    if not spec_of(cfg.algo.name).generates and cfg.trainer.global_batch_size < data_parallel_size(cfg):
        raise UserError(
            f"trainer.global_batch_size={cfg.trainer.global_batch_size} is smaller than the {data_parallel_size(cfg)} "
            "data-parallel ranks: every rank needs at least one example per step. Raise the batch or lower "
            "trainer.nproc."
        )
    if cfg.sweep.last_n < 1:
        raise UserError(f"sweep.last_n={cfg.sweep.last_n} must be at least 1 (the objective averages that many logged values).")
    if cfg.logger.sample_every < 0:
        raise UserError(
            f"logger.sample_every={cfg.logger.sample_every} must be 0 (sample tables at evaluation only) or a number of steps."
        )
    if cfg.optim.lr <= 0:
        raise UserError(f"optim.lr={cfg.optim.lr} must be positive.")


def validate_reward(cfg: Config) -> None:
    if cfg.reward.timeout_s is not None and cfg.reward.timeout_s < 0:
        raise UserError(f"reward.timeout_s={cfg.reward.timeout_s} must be positive (seconds), or 0 / null for no limit.")
    if cfg.reward.workers < 1 or cfg.reward.chunk_size < 0:
        raise UserError(
            f"reward.workers={cfg.reward.workers} must be at least 1 and reward.chunk_size={cfg.reward.chunk_size} at "
            "least 0 (0: one prompt's group per call)."
        )
    if not 0 <= cfg.reward.max_failure_frac <= 1:
        raise UserError(f"reward.max_failure_frac={cfg.reward.max_failure_frac} must be in [0, 1] (a share of a step's samples).")


def validate_safety(cfg: Config) -> None:
    if cfg.safety.collective_timeout_s <= 0 or cfg.safety.max_consecutive_errors < 0:
        raise UserError(
            f"safety.collective_timeout_s={cfg.safety.collective_timeout_s} must be positive and "
            f"safety.max_consecutive_errors={cfg.safety.max_consecutive_errors} at least 0."
        )
    if cfg.safety.max_logprob_diff is not None and cfg.safety.max_logprob_diff < 0:
        raise UserError(
            f"safety.max_logprob_diff={cfg.safety.max_logprob_diff} must be a positive limit (nats), 0 (no check) or "
            "null (auto: 1e-2 in fp32, none in bf16)."
        )


def validate_model(model: ModelConfig) -> None:
    check_revision("model", model)
    aux, z = model.moe.aux_loss_coef, model.moe.z_loss_coef
    if (aux is not None and aux < 0) or z < 0:
        raise UserError(
            f"model.moe.aux_loss_coef={aux} and model.moe.z_loss_coef={z}: a router loss's coefficient is at least 0 "
            "(0 turns it off; aux_loss_coef=null keeps the checkpoint's own setting, off for RL). docs/moe.md."
        )
    if model.path is None:
        if model.num_heads < 1 or model.hidden_size % model.num_heads:
            raise UserError(
                f"model.hidden_size={model.hidden_size} is not divisible by model.num_heads={model.num_heads}: "
                "every attention head gets hidden_size / num_heads dimensions."
            )
        if model.num_kv_heads < 1 or model.num_heads % model.num_kv_heads:
            raise UserError(
                f"model.num_heads={model.num_heads} is not divisible by model.num_kv_heads={model.num_kv_heads}: "
                "each key/value head serves the same number of query heads."
            )
        if model.arch == "qwen2" and not model.attention_bias:
            raise UserError("model.attention_bias=false needs model.arch=llama (Qwen2 always has q/k/v biases).")
        if model.arch == "qwen3_moe":
            validate_tiny_moe(model)
        return
    validate_model_source("model", model, "leave it unset for the built-in tiny model")


def validate_tiny_moe(model: ModelConfig) -> None:
    """The tiny MoE's shape (model=tiny_moe, rltrain/models/tiny_moe.py)."""
    if model.hidden_size != model.num_heads * TINY_MOE_HEAD_DIM:
        raise UserError(
            f"model.hidden_size={model.hidden_size} must be model.num_heads={model.num_heads} x {TINY_MOE_HEAD_DIM} for "
            f"the tiny MoE (model.arch=qwen3_moe): its heads have {TINY_MOE_HEAD_DIM} dimensions, the smallest vLLM's "
            "CPU attention accepts. Change one of the two."
        )
    experts = model.moe
    if experts.num_experts < 2 or not 1 <= experts.experts_per_token <= experts.num_experts:
        raise UserError(
            f"model.moe.num_experts={experts.num_experts} and model.moe.experts_per_token={experts.experts_per_token}: "
            "the tiny MoE needs at least 2 experts, and routes each token to between 1 and num_experts of them."
        )
    if experts.expert_intermediate_size < 1:
        raise UserError(f"model.moe.expert_intermediate_size={experts.expert_intermediate_size} must be at least 1.")


def validate_lora(cfg: Config) -> None:
    """model.lora: values peft accepts, on the backend that supports it (docs/lora.md)."""
    lora = cfg.model.lora
    if lora.rank < 0:
        raise UserError(f"model.lora.rank={lora.rank} must be 0 (full fine-tuning) or a positive adapter rank (e.g. 8).")
    if lora.rank == 0:
        return
    if cfg.backend.name != "fsdp":
        raise UserError(
            f"model.lora.rank={lora.rank} with backend={cfg.backend.name}: LoRA adapters are trained on the FSDP backend "
            "only. Set backend=fsdp, or model.lora.rank=0 for full fine-tuning on Megatron."
        )
    if lora.alpha <= 0:
        raise UserError(f"model.lora.alpha={lora.alpha} must be positive (the adapters' update is scaled by alpha / rank).")
    if not 0 <= lora.dropout < 1:
        raise UserError(f"model.lora.dropout={lora.dropout} must be in [0, 1).")
    targets = list(lora.target_modules)
    if not targets:
        raise UserError("model.lora.target_modules is empty: name the modules to adapt (e.g. [q_proj,v_proj]), or [all-linear].")
    from rltrain.config.schema import LORA_UNSUPPORTED_TARGETS as UNSUPPORTED_TARGETS

    if bad := [t for t in targets if t in UNSUPPORTED_TARGETS]:
        raise UserError(
            f"model.lora.target_modules={targets}: {', '.join(bad)} cannot take an adapter here (the embeddings and the "
            "LM head are tied or indexed, not multiplied). Adapt the decoder's linear layers: [all-linear]."
        )


def validate_data(cfg: Config) -> None:
    data = cfg.data
    if not 0 <= data.eval_fraction < 1:
        raise UserError(f"data.eval_fraction={data.eval_fraction} must be in [0, 1): the share of data.path held out.")
    if data.num_train < 0 or data.max_eval_samples < 0:
        raise UserError(
            f"data.num_train={data.num_train} and data.max_eval_samples={data.max_eval_samples} must be at least 0."
        )
    if data.eval_seed is not None and data.eval_seed < 0:
        raise UserError(f"data.eval_seed={data.eval_seed} must be at least 0 (null: the held-out problems follow trainer.seed).")
    if not 0 <= data.same_length_rejected <= 1:
        raise UserError(
            f"data.same_length_rejected={data.same_length_rejected} must be between 0 and 1 (the share of the built-in "
            "task's rejected answers that have the right answer's length, one digit changed)."
        )
    if data.path is None and data.task == "colours" and cfg.model.path is None and cfg.model.arch != "qwen2_vl":
        raise UserError(
            "data.task=colours is a visual task (a picture and a question only the picture answers) but the model is "
            "the text-only tiny model. Use model=tiny_vl_sft (its SFT start) or model=tiny_vl, or +experiment=grpo_vision."
        )
    if data.task == "reasoning_gym":
        validate_reasoning_gym(cfg)
    size = TASK_SIZES.get(data.task, data.num_eval + 1)  # reasoning-gym's tasks are as large as their generators make them
    if data.path is None and not 1 <= data.num_eval < size:
        raise UserError(
            f"data.num_eval={data.num_eval} must be between 1 and {size - 1}: the built-in {data.task!r} task has "
            f"{size:,} problems and holds that many out for evaluation."
        )
    if data.path is None and data.task == "code" and spec_of(cfg.algo.name).data in ("preferences", "unpaired"):
        raise UserError(NO_CODE_PAIRS.format(task=data.task))
    carry_keys: dict[str, tuple[Any, str]] = {
        "data.max_carry_problems": (data.max_carry_problems, "null"),
        "model.sft_carry_problems": (cfg.model.sft_carry_problems, "null"),
        "data.forgotten_carries": (data.forgotten_carries, "0"),
        "model.sft_forgotten_carries": (cfg.model.sft_forgotten_carries, "0"),
    }
    for key, (value, _) in carry_keys.items():
        if "carry_problems" in key and value is not None and value < 0:
            raise UserError(f"{key}={value} must be at least 0 (null: every training problem whose sum carries).")
        if "forgotten" in key and not 0 <= value <= 1:
            raise UserError(
                f"{key}={value} must be between 0 and 1 (the share of SFT sums carrying out of the units shown with that "
                "carry forgotten)."
            )
    if data.task != "addition":
        # The model.* keys matter only when an SFT start is built on this task.
        used = {
            k: (value, off) for k, (value, off) in carry_keys.items()
            if (value is not None if off == "null" else value != 0) and (k.startswith("data.") or cfg.model.sft_steps > 0)
        }
        if used:
            settings = ", ".join(f"{k}={v}" for k, (v, _) in used.items())
            fixes = " ".join(f"{k}={off}" for k, (_, off) in used.items())
            raise UserError(f"{settings}: only data.task=addition has sums that carry, not {data.task!r}. Set {fixes}.")


def validate_algo(algo: AlgoConfig) -> None:
    """Values of algorithm-specific keys: each algorithm's own check (rltrain.config.algorithms)."""
    spec_of(algo.name).check(algo)


def validate_vllm(rollout: VLLMRolloutConfig) -> None:
    """The vLLM engine's CUDA settings (docs/time-sharing-and-sync.md, "vLLM on CUDA"); checked on every machine, so a
    config that would fail on the cluster fails on a laptop first."""
    util = rollout.gpu_memory_utilization
    if not 0 < util <= 1:
        raise UserError(
            f"rollout.gpu_memory_utilization={util} must be in (0, 1]: the fraction of the GPU's memory the vLLM "
            "engine may take for its weights, activations and KV cache (e.g. 0.5 when the trainer shares the GPU)."
        )
    if rollout.sleep_level not in (1, 2):
        raise UserError(
            f"rollout.sleep_level={rollout.sleep_level} is not 1 or 2: vLLM's sleep between rollout turns either "
            "keeps the weights in host memory (1) or discards them, to be sent again after the wake (2)."
        )
    if rollout.tensor_parallel_size < 1:
        raise UserError(f"rollout.tensor_parallel_size={rollout.tensor_parallel_size} must be at least 1.")
    if rollout.num_threads < 0:
        raise UserError(f"rollout.num_threads={rollout.num_threads} must be 0 (the trainer's count) or a number of threads.")
    if rollout.max_model_len is not None and rollout.max_model_len < 1:
        raise UserError(
            f"rollout.max_model_len={rollout.max_model_len} must be at least 1, or null for the model's own limit."
        )


def validate_compile(cfg: Config) -> None:
    """`backend.compile=true` (FSDP) needs a C++ compiler: inductor builds its CPU kernels with one
    (and on CUDA, triton its kernel launchers). The compiler inductor looks for is `$CXX`, else g++
    (clang++ on macOS); without it the run would fail at the first forward, after the model is built."""
    if cfg.backend.name != "fsdp" or not cfg.backend.compile:
        return
    compiler = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
    if shutil.which(compiler) is None:
        raise UserError(
            f"backend.compile=true needs a C++ compiler, and {compiler!r} (from $CXX, else the platform's default) "
            "is not on PATH: torch.compile's inductor builds the compiled decoder layers with it. Install one "
            "(e.g. apt-get install g++), point CXX at it, or set backend.compile=false."
        )
