"""Structured config: one dataclass per Hydra group, registered in Hydra's ConfigStore.

Every group's YAML file in `conf/` extends the schema stored here (`<group>/<name>_schema`), so a
misspelt key or a value of the wrong type fails while Hydra composes the config, before any model
is built. Code reads config through these fields only (never `.get(key, default)`), so a default
lives in exactly one place: here. So do the allowed values of every enum-like key: a `Literal` below,
attached to its field by `choice()`; rltrain.config.validate checks them and the code that reads a
key takes its values from the same `Literal`. docs/configuration.md lists every key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

Resume = Literal["auto", "never"]
Progress = Literal["auto", "bar", "lines"]
Precision = Literal["auto", "fp32", "bf16-mixed", "bf16"]  # auto: bf16-mixed on CUDA, fp32 on CPU
Overlong = Literal["drop", "truncate", "error"]
Task = Literal["addition", "multiplication"]  # the built-in tasks (rltrain/data/tasks.py)
WandbMode = Literal["auto", "online", "offline", "disabled"]  # auto: online with an API key, else offline
Schedule = Literal["cosine", "linear", "constant"]
Arch = Literal["qwen2", "llama"]  # the tiny model only
DPOLossType = Literal["sigmoid", "ipo", "hinge", "robust"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
RolloutCorrection = Literal["auto", "none", "tis", "mask"]  # auto: none in sync, tis with placement.max_staleness >= 1
ScaleRewards = Literal["group", "batch", "none"]
RolloutProcess = Literal["colocated", "separate"]  # separate: the engine in a child process (rollout/separate.py)
SweepDirection = Literal["maximize", "minimize"]
EnvName = Literal["none", "python", "tools"]  # rltrain/envs


def choice(default: str, allowed: Any) -> Any:
    """A string field whose values are the `Literal` `allowed`. OmegaConf types it as `str` (it has
    no Literal type); rltrain.config.validate refuses any other value, naming the allowed ones."""
    values = get_args(allowed)
    assert default in values, f"default {default!r} is not one of {values}"
    return field(default=default, metadata={"choices": values})


def choices_of(cls: type) -> dict[str, tuple[str, ...]]:
    """{field name: allowed values} of the `choice()` fields of a schema dataclass."""
    return {f.name: f.metadata["choices"] for f in dataclasses.fields(cls) if "choices" in f.metadata}


@dataclass
class TrainerConfig:
    max_steps: int = 200
    seed: int = 0
    nproc: int = 1
    resume: str = choice("auto", Resume)
    save_every: int = 100
    keep_checkpoints: int = 2
    eval_every: int = 100
    global_batch_size: int = 64
    micro_batch_size: int = 64
    max_tokens_per_micro_batch: int = 0  # > 0: micro-batches also capped at this many tokens (data/sharding.py)
    log_every: int = 10
    progress: str = choice("auto", Progress)
    num_threads: int = 0  # torch intra-op threads per rank; 0 = usable cores (CPU affinity) / nproc
    deterministic: bool = True
    precision: str = choice("auto", Precision)


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-8
    warmup_steps: int = 20
    schedule: str = choice("cosine", Schedule)
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0


@dataclass
class LoraAdapterConfig:
    """Low-rank adapters on the policy (peft), FSDP backend only. docs/lora.md."""

    rank: int = 0  # 0 = full fine-tuning; > 0 trains rank-r adapters and freezes the base
    alpha: int = 16  # the adapters' update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input (training passes only)
    # Module names to adapt (peft's target_modules); [all-linear] = every linear layer of the
    # decoder (attention and MLP projections, not the LM head).
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    save_merged: bool = False  # final/merged/: the base with the adapters merged in, a plain HF model


@dataclass
class ModelConfig:
    """`path=null` builds the embedded tiny model; otherwise a Hugging Face model directory or Hub id
    (rltrain/models/hub.py)."""

    path: str | None = None
    revision: str | None = None  # a Hub id's branch, tag or commit; null = main
    arch: str = choice("qwen2", Arch)
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    tie_word_embeddings: bool = True
    attention_bias: bool = True
    max_position_embeddings: int = 512
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in the backward
    cache_dir: str | None = None  # where the built tiny model is cached; null = ~/.cache/rltrain
    # model=tiny_sft: SFT the tiny model this many steps on the built-in task's training split
    # first (rltrain/models/tiny_sft.py), so RL starts from answers it can sharpen; 0 = no SFT.
    sft_steps: int = 0
    sft_lr: float = 1e-3
    sft_carry_problems: int | None = None  # its data.max_carry_problems (the RL run keeps every problem)
    lora: LoraAdapterConfig = field(default_factory=LoraAdapterConfig)


@dataclass
class DataColumns:
    """Which of the dataset's columns plays each conventional (TRL) column: `prompt: question` gives
    every row a `prompt` holding its `question` (which stays). null: the dataset's own column."""

    prompt: str | None = None
    completion: str | None = None
    messages: str | None = None
    chosen: str | None = None
    rejected: str | None = None
    solution: str | None = None  # what rltrain.rewards.math:accuracy compares with


@dataclass
class DataConfig:
    """`path=null` uses the built-in synthetic task named by `task`; otherwise a file, a saved dataset
    or a Hub dataset id (rltrain/data/loading.py, docs/models-and-data.md)."""

    path: str | None = None
    name: str | None = None  # a Hub dataset's configuration (e.g. main for openai/gsm8k)
    revision: str | None = None  # a Hub dataset's branch, tag or commit; null = main
    split: str = "train"
    columns: DataColumns = field(default_factory=DataColumns)
    map_fn: str | None = None  # pkg.module:fn, one row in, the columns to set out (datasets.map), after `columns`
    eval_path: str | None = None
    eval_fraction: float = 0.05
    task: str = choice("addition", Task)
    num_train: int = 0  # built-in task: 0 = every problem not held out
    max_carry_problems: int | None = None  # built-in task: keep this many training sums that carry; null = all
    num_eval: int = 200
    eval_seed: int | None = None  # built-in task: the held-out draw's seed; null = trainer.seed
    max_length: int = 256
    overlong: str = choice("drop", Overlong)
    max_eval_samples: int = 200


@dataclass
class WandbConfig:
    mode: str = choice("auto", WandbMode)
    project: str = "rltrain"
    entity: str | None = None
    group: str | None = None  # null: the sweep directory's name in a multirun
    name: str | None = None


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # GRPO: a `samples/train` table of prompts, completions and rewards every N steps; 0 = only the
    # `samples/eval` table at each evaluation (docs/run-directory.md).
    sample_every: int = 0


@dataclass
class SweepConfig:
    """What a sweep job returns to the sweeper (Optuna) and `sweep_summary.csv` (rltrain/launch/sweep.py):
    the mean of the last `last_n` logged values of the metric `objective`."""

    objective: str = "eval/accuracy"
    direction: str = choice("maximize", SweepDirection)
    last_n: int = 1


@dataclass
class AlgoConfig:
    name: str = MISSING


@dataclass
class SFTConfig(AlgoConfig):
    name: str = "sft"


@dataclass
class DPOConfig(AlgoConfig):
    name: str = "dpo"
    beta: float = 0.1
    loss_type: str = choice("sigmoid", DPOLossType)
    label_smoothing: float = 0.0
    sft_weight: float = 0.0
    precompute_ref_logps: bool = False


@dataclass
class RLConfig(AlgoConfig):
    """What every RL algorithm shares: the experience pipeline, the clipped policy loss and the
    rollout correction (rltrain/algos/rl.py)."""

    group_size: int = 8
    prompts_per_step: int = 16
    mini_batches: int = 1
    num_iterations: int = 1
    loss_agg: str = choice("token_mean", LossAgg)
    clip_low: float = 0.2
    clip_high: float = 0.28
    beta: float = 0.0  # KL to the reference (0: no reference model)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 6
    rollout_correction: str = choice("auto", RolloutCorrection)
    rollout_is_cap: float = 2.0  # tis: token importance weights truncated at this value
    rollout_mask_band: float = 2.0  # mask: keep sequences whose train/rollout ratio is in [1/band, band]


@dataclass
class GRPOConfig(RLConfig):
    name: str = "grpo"
    scale_rewards: str = choice("group", ScaleRewards)


@dataclass
class PPOConfig(RLConfig):
    name: str = "ppo"
    gamma: float = 1.0  # GAE discount
    lam: float = 0.95  # GAE lambda
    vf_clip: float = 0.2  # clipped value loss: values move at most this far from the old ones
    critic_warmup_steps: int = 0  # the first steps train the critic only
    whiten_advantages: bool = True
    kl_in_reward: bool = False  # true: -beta * KL per token in the reward; false: beta * k3 in the loss


@dataclass
class BackendConfig:
    name: str = MISSING


@dataclass
class FSDPBackendConfig(BackendConfig):
    name: str = "fsdp"
    reshard_after_forward: bool = True
    # A micro-batch of unrelated sequences is one packed row with document-masked attention
    # (rltrain/backends/fsdp/padding_free.py) instead of a padded rectangle or length buckets.
    padding_free: bool = False
    compile: bool = False  # torch.compile each decoder layer (rltrain/backends/fsdp/compile_layers.py)
    # Sequences that share a prompt (GRPO groups, DPO pairs) are packed one row per prompt, so the
    # prompt is computed once (rltrain/backends/fsdp/shared_prefix.py). Never for MoE models.
    share_prompts: bool = True
    # On one rank, a micro-batch is scored as a few rectangles of similar lengths instead of one
    # padded to its longest row. Never on sharded ranks or for MoE models.
    length_buckets: bool = True


@dataclass
class MegatronBackendConfig(BackendConfig):
    name: str = "megatron"
    tp: int = 1
    pp: int = 1


@dataclass
class RolloutConfig:
    name: str = MISSING
    seed: int = 0


@dataclass
class VLLMRolloutConfig(RolloutConfig):
    name: str = "vllm"
    process: str = choice("colocated", RolloutProcess)
    kv_cache_gib: float = 1.0  # CPU: the KV-cache budget (on CUDA, gpu_memory_utilization decides)
    max_num_seqs: int = 256
    max_model_len: int | None = None  # longest prompt + completion; null = the model's own limit
    # vLLM on CUDA (docs/time-sharing-and-sync.md, "vLLM on CUDA"); the CPU build takes none of these:
    gpu_memory_utilization: float = 0.5  # fraction of the GPU the engine may take (weights + KV cache)
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # true: no CUDA graphs (the CPU build always runs eagerly)
    sleep_level: int = 1  # time sharing: 1 keeps the weights in host memory, 2 drops them (resynced)
    bucket_mb: int = 64  # process=separate: shared-memory bucket size of the weight transport
    timeout_s: float = 300.0  # process=separate: bound on every wait for the child (a reply, a bucket)
    start_timeout_s: float = 600.0  # process=separate: bound on the child building its engine
    num_threads: int = 0  # process=separate: the engine's torch threads; 0 = the trainer's (docs/async.md)


@dataclass
class HFRolloutConfig(RolloutConfig):
    name: str = "hf"


@dataclass
class ReferenceConfig:
    """The frozen reference (DPO always; GRPO when `algo.beta > 0`). `path=null`: the policy's initial
    weights; else a Hugging Face model directory or Hub id sharing the policy's tokenizer (rltrain/backends/roles.py)."""

    path: str | None = None
    revision: str | None = None  # a Hub id's branch, tag or commit; null = main


@dataclass
class CriticConfig:
    """The value model (PPO). `path=null`: the policy's initial weights with a fresh scalar value
    head; else a Hugging Face model directory or Hub id sharing the policy's tokenizer. Its own optimizer
    takes `lr` and every other `optim.*` setting."""

    path: str | None = None
    revision: str | None = None  # a Hub id's branch, tag or commit; null = main
    lr: float = 1e-3  # on the embedded default, 1e-2 leaves the critic predicting the mean return (explained variance ~0)


@dataclass
class RewardModelConfig:
    """A sequence classifier scoring prompt + completion, added to `reward.fns` with `weight`
    (rltrain/rewards/model_reward.py); logged as `reward/model`."""

    name: str = MISSING
    path: str | None = None  # a Hugging Face AutoModelForSequenceClassification directory or Hub id, num_labels=1
    revision: str | None = None  # a Hub id's branch, tag or commit; null = main
    weight: float = 1.0
    batch_size: int = 32  # texts per forward pass
    max_length: int = 1024  # tokens per text; longer texts lose their beginning (the score reads the end)


@dataclass
class NoRewardModelConfig(RewardModelConfig):
    name: str = "none"


@dataclass
class HFRewardModelConfig(RewardModelConfig):
    name: str = "hf"


@dataclass
class EnvConfig:
    """Multi-turn episodes (docs/environments.md). `none`: single-turn RL, one completion per sample
    scored by `reward.fns`. `python`: `cls` (`pkg.module:Class`) is a user environment with
    `reset(**row)` and `step(text)`; one instance per episode, run in worker processes that a timeout kills.
    `tools`: `tools` (`pkg.module:function` each) are offered to the model, called in those workers, and
    the episode's last reply is scored by `reward.fns`."""

    name: str = MISSING
    cls: str | None = None
    tools: list[str] = field(default_factory=list)  # env=tools: the functions offered to the model
    describe_tools: bool = True  # env=tools: list the tools in a text prompt (a chat prompt gets them from its template)
    max_turns: int = 4  # model turns per episode
    max_tokens_per_turn: int | None = None  # one turn's generation budget; null = algo.max_new_tokens
    max_total_tokens: int = 256  # an episode's completion: every model turn and observation
    timeout_s: float | None = 30.0  # bound on one reset or step; a failed episode scores reward.on_failure
    workers: int = 1  # worker processes per rank that host the episodes


@dataclass
class NoEnvConfig(EnvConfig):
    name: str = "none"


@dataclass
class PythonEnvConfig(EnvConfig):
    name: str = "python"


@dataclass
class ToolsEnvConfig(EnvConfig):
    name: str = "tools"


@dataclass
class RewardConfig:
    """Reward functions by dotted path (`pkg.module:function`); empty = the built-in task's reward."""

    fns: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    timeout_s: float | None = 60.0  # bound on each call (one chunk); 0 or null: no limit
    workers: int = 1  # worker processes per rank that run the functions (killed and replaced on a timeout)
    chunk_size: int = 0  # completions per call: 0 = one prompt's group; N = at most N of one group
    chunk_spans_groups: bool = False  # true: chunks of chunk_size may hold several prompts' completions
    on_failure: float = 0.0  # the reward of a sample whose call raised, returned nonsense or timed out
    max_failure_frac: float = 0.25  # a rank stops when more of its step's samples fail for one function


@dataclass
class SafetyConfig:
    """See docs/failure-behaviour.md."""

    fail_fast: bool = False  # RLTRAIN_FAIL_FAST=1/0 overrides
    collective_timeout_s: float = 600.0
    max_consecutive_errors: int = 3  # more consecutive steps with a recovered error fail the run
    # RL: stop when rollout/logprob_diff_max exceeds this (the engine is not sampling from the
    # trainer's weights); null = auto (1e-2 in fp32, off in bf16), 0 = off (rltrain/safety/parity.py)
    max_logprob_diff: float | None = None


@dataclass
class HealthConfig:
    port: int | None = None  # rank 0 serves /healthz and /healthz/deep here; 0 = any free port
    host: str = "127.0.0.1"  # 0.0.0.0 for a cluster's probes
    stale_after_s: float = 60.0
    ping_timeout_s: float = 5.0  # the deep check's rollout-engine ping
    hang_timeout_s: float = 0.0  # 0 = no watchdog


@dataclass
class PlacementConfig:
    time_sharing: bool = False
    max_staleness: int = 0  # >= 1: generate up to this many steps ahead of the trainer (docs/async.md)


@dataclass
class DebugConfig:
    fault: str | None = None  # KIND:RANK:STEP, a testing aid (docs/failure-behaviour.md)


@dataclass
class Config:
    algo: Any = MISSING
    backend: Any = MISSING
    rollout: Any = None
    model: ModelConfig = field(default_factory=ModelConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: Any = MISSING
    env: Any = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)


GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "algo": {"sft": SFTConfig, "dpo": DPOConfig, "grpo": GRPOConfig, "ppo": PPOConfig},
    "backend": {"fsdp": FSDPBackendConfig, "megatron": MegatronBackendConfig},
    "rollout": {"vllm": VLLMRolloutConfig, "hf": HFRolloutConfig},
    "model": {"tiny": ModelConfig, "tiny_sft": ModelConfig},
    "reference": {"default": ReferenceConfig},
    "critic": {"default": CriticConfig},
    "reward_model": {"none": NoRewardModelConfig, "hf": HFRewardModelConfig},
    "env": {"none": NoEnvConfig, "python": PythonEnvConfig, "tools": ToolsEnvConfig},
    "data": {"default": DataConfig},
    "logger": {"default": LoggerConfig},
}


def register_configs() -> None:
    """Store the root schema and one `<name>_schema` node per group option."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, options in GROUP_SCHEMAS.items():
        for name, schema in options.items():
            cs.store(group=group, name=f"{name}_schema", node=schema)
