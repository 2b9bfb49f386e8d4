"""Structured config: the run's own sections and the root `Config`, registered in Hydra's ConfigStore.

Every group's YAML file in `conf/` extends the schema stored here (`<group>/<name>_schema`), so a
misspelt key or a value of the wrong type fails while Hydra composes the config, before any model
is built. The options a group chooses between (algo, backend, rollout, ...) are in
rltrain.config.group_options. Code reads config through these fields only (never `.get(key, default)`),
so a default lives in exactly one place. So do the allowed values of every enum-like key: a `Literal`
beside its field, attached by `choice()` (rltrain.config.choices); rltrain.preflight.validate checks them
and the code that reads a key takes its values from the same `Literal`. docs/configuration.md lists every key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from rltrain.config.algorithms import ALGORITHM_CONFIGS
from rltrain.config.choices import choice
from rltrain.config.group_options import (
    AgentEnvConfig,
    CriticConfig,
    FSDPBackendConfig,
    HFRewardModelConfig,
    HFRolloutConfig,
    JudgeRewardModelConfig,
    MegatronBackendConfig,
    NoEnvConfig,
    NoRewardModelConfig,
    OpenEnvEnvConfig,
    PythonEnvConfig,
    ReferenceConfig,
    ServerRolloutConfig,
    TeacherConfig,
    TextArenaEnvConfig,
    ToolsEnvConfig,
    VLLMRolloutConfig,
)
from rltrain.runtime.precision import PrecisionName as Precision

Resume = Literal["auto", "never"]
Progress = Literal["auto", "bar", "lines"]
Overlong = Literal["drop", "truncate", "error"]
Task = Literal["addition", "multiplication", "code", "colours", "reasoning_gym"]  # the built-in tasks (rltrain/data/tasks.py)
SandboxMode = Literal["bwrap", "rlimits", "remote"]  # rltrain/rewards/sandbox (docs/rewards-and-roles.md)
WandbMode = Literal["auto", "online", "offline", "disabled"]  # auto: online with an API key, else offline
TrackerName = Literal["wandb", "tensorboard", "mlflow", "trackio"]  # logger.backends (rltrain/run/trackers)
Schedule = Literal["cosine", "linear", "constant"]
# AdamW's kernels (torch.optim.AdamW): one launch per tensor, per tensor list, or one fused kernel.
OptimImplementation = Literal["auto", "for-loop", "foreach", "fused"]
Arch = Literal["qwen2", "llama", "qwen2_vl", "qwen3_moe"]  # the tiny model only (qwen2_vl: model=tiny_vl, qwen3_moe: model=tiny_moe)
SweepDirection = Literal["maximize", "minimize"]

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")  # the YAML tree every group's option lives in


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
    # auto: the backend's (FSDP foreach, megatron for-loop); fused is one kernel per step, for GPUs (docs/gpus.md)
    implementation: str = choice("auto", OptimImplementation)


# Modules an adapter may not target (model.lora.target_modules): their weights are tied or indexed, not multiplied.
LORA_UNSUPPORTED_TARGETS = ("lm_head", "embed_tokens")


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


TINY_MOE_HEAD_DIM = 32  # the tiny MoE's attention head size: the smallest vLLM's CPU attention accepts


@dataclass
class MoEConfig:
    """Mixture-of-Experts settings (docs/moe.md). The shape keys build the tiny MoE
    (model=tiny_moe, rltrain/models/tiny_moe.py); a `model.path` checkpoint has its own shape.
    The loss coefficients apply to any MoE."""

    num_experts: int = 8  # experts per MoE layer of the tiny MoE
    experts_per_token: int = 2  # its router's top-k
    expert_intermediate_size: int = 128  # each expert's MLP width
    # The router's training losses: load balancing (null: the checkpoint's own setting, off for RL)
    # and z-loss (0: off), on any MoE under backend=fsdp
    aux_loss_coef: float | None = None
    z_loss_coef: float = 0.0


@dataclass
class ModelConfig:
    """`path=null` builds the embedded tiny model; otherwise a Hugging Face model directory or Hub id
    (rltrain/config/hub.py)."""

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
    freeze_vision: bool = True  # a vision-language model's vision tower stays as loaded (docs/vision.md)
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in the backward
    cache_dir: str | None = None  # where the built tiny model is cached; null = ~/.cache/rltrain
    # model=tiny_sft: SFT the tiny model this many steps on the built-in task's training split
    # first (rltrain/models/tiny_sft.py), so RL starts from answers it can sharpen; 0 = no SFT.
    sft_steps: int = 0
    sft_lr: float = 1e-3
    sft_carry_problems: int | None = None  # its data.max_carry_problems (the RL run keeps every problem)
    sft_forgotten_carries: float = 0.0  # its data.forgotten_carries (the RL run's reward wants every carry)
    lora: LoraAdapterConfig = field(default_factory=LoraAdapterConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)


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
    input_output: str | None = None  # rltrain.rewards.code:tests_pass's stdin/stdout cases
    test: str | None = None  # rltrain.rewards.code:tests_pass's assert statements
    entry_point: str | None = None  # the function a `test`'s check(candidate) is called on
    images: str | None = None  # a row's images (a list, or one): docs/vision.md


@dataclass
class DataConfig:
    """`path=null` uses the built-in synthetic task named by `task`; otherwise a file, a saved dataset
    or a Hub dataset id (rltrain/data/loading.py, docs/models-and-data.md)."""

    path: str | None = None
    name: str | None = None  # a Hub dataset's configuration (e.g. main for openai/gsm8k)
    revision: str | None = None  # a Hub dataset's branch, tag or commit; null = main
    split: str = "train"
    columns: DataColumns = field(default_factory=DataColumns)
    # Arguments every chat template rendering of the run gets (data, environments, the agents'
    # endpoint), e.g. {enable_thinking: false} for a reasoning model's template
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    map_fn: str | None = None  # pkg.module:fn, one row in, the columns to set out (datasets.map), after `columns`
    eval_path: str | None = None
    eval_fraction: float = 0.05
    task: str = choice("addition", Task)
    # data=reasoning_gym (task: reasoning_gym): the generators, NAME or {name, weight, eval_size, <generator config keys>}
    tasks: list[Any] = field(default_factory=list)
    num_train: int = 0  # built-in task: 0 = every problem not held out
    max_carry_problems: int | None = None  # built-in task: keep this many training sums that carry; null = all
    forgotten_carries: float = 0.0  # built-in task: this share of the SFT's units carries shown forgotten
    same_length_rejected: float = 0.0  # built-in task's preference pairs: this share of rejected answers of the right length
    num_eval: int = 200
    eval_seed: int | None = None  # built-in task: the held-out draw's seed; null = trainer.seed
    max_length: int = 256
    overlong: str = choice("drop", Overlong)
    max_eval_samples: int = 200  # a dataset's eval rows at most (the built-in task evaluates all data.num_eval)


@dataclass
class WandbConfig:
    mode: str = choice("auto", WandbMode)
    project: str = "rltrain"
    entity: str | None = None
    group: str | None = None  # null: the sweep directory's name in a multirun
    name: str | None = None


@dataclass
class MlflowConfig:
    tracking_uri: str | None = None  # null: a local file store in RUN_DIR/mlruns; else an MLflow server's URI


@dataclass
class TrackioConfig:
    space_id: str | None = None  # null: trackio's local database only; else a Hugging Face Space to sync to


@dataclass
class LoggerConfig:
    """Where metrics go beside metrics.jsonl: any of the `TrackerName`s (docs/trackers.md). Every tracker
    takes the run's project, group and name from `logger.wandb`."""

    backends: list[str] = field(default_factory=lambda: ["wandb"])
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    trackio: TrackioConfig = field(default_factory=TrackioConfig)
    # GRPO: a `samples/train` table of prompts, completions and rewards every N steps; 0 = only the
    # `samples/eval` table at each evaluation (docs/run-directory.md).
    sample_every: int = 0
    # The run's `plots.png` when it ends (and in its trackers); false skips it, e.g. in a sweep of many
    # short jobs, where `python -m rltrain.plot SWEEP_DIR` draws them all in one PNG afterwards.
    plot: bool = True


@dataclass
class SweepConfig:
    """What a sweep job returns to the sweeper (Optuna) and `sweep_summary.csv` (rltrain/launch/sweep.py):
    the mean of the last `last_n` logged values of the metric `objective`."""

    objective: str = "eval/accuracy"
    direction: str = choice("maximize", SweepDirection)
    last_n: int = 1


@dataclass
class EvalConfig:
    """Sampled evaluation beside the greedy one (GRPO and PPO): `eval/pass@k`, `eval/mean@K`,
    `eval/maj@K` (rltrain.run.sampled_metrics, docs/evaluation.md)."""

    samples: int = 0  # K completions per held-out prompt at `temperature`; 0 = the greedy evaluation only
    temperature: float = 1.0
    k: list[int] | None = None  # pass@k for each (1 <= k <= K); null: 1, 2, 4, ... below K, and K
    only: bool = False  # evaluate the model once (step 0) and stop: no training, checkpoint or final/ (`python -m rltrain.eval`)


@dataclass
class CodeRewardConfig:
    """rltrain.rewards.code:tests_pass (docs/rewards-and-roles.md, "Code")."""

    all_or_nothing: bool = False  # true: 1.0 only when every case passes; false: the fraction passed


@dataclass
class SandboxConfig:
    """Where and how the code rewards run model-written code (rltrain/rewards/sandbox)."""

    # bwrap: bubblewrap namespaces + limits; rlimits: limits only (no file or network isolation);
    # remote: a SandboxFusion service at `url`
    mode: str = choice("bwrap", SandboxMode)
    url: str | None = None  # mode=remote: the SandboxFusion service, e.g. http://host:8080
    workers: int = 4  # executions at once per reward call
    python: str | None = None  # the interpreter the code runs with; null: the one rltrain runs on, without its packages
    timeout_s: float = 5.0  # wall clock per execution (one test case)
    cpu_s: int = 5  # CPU seconds per execution (RLIMIT_CPU)
    memory_mb: int = 1024  # address space per process (RLIMIT_AS)
    file_size_mb: int = 16  # largest file the code may write (RLIMIT_FSIZE)
    tmp_mb: int = 64  # its private temporary directory, all files together (bwrap)
    processes: int = 16  # processes and threads it may run at once (RLIMIT_NPROC)
    output_bytes: int = 1048576  # stdout + stderr per execution; more is killed


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
    # The built-in answer rewards (code, math) read a completion after its last one; null: the
    # closing tag the tokenizer's chat template uses (</think> where it has none); "": all of it
    thinking_end: str | None = None
    code: CodeRewardConfig = field(default_factory=CodeRewardConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


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


WeightUpdate = Literal["between_batches", "in_flight"]


@dataclass
class PlacementConfig:
    time_sharing: bool = False
    max_staleness: int = 0  # >= 1: generate up to this many steps ahead of the trainer (docs/async.md)
    # in_flight: the separate engine takes each new version between two decoding steps (docs/async.md)
    weight_update: str = choice("between_batches", WeightUpdate)
    stream: bool = False  # in_flight: a batch is the first algo.prompts_per_step groups to complete
    deterministic: bool = False  # in_flight: versions applied at scheduled decode steps, not when they arrive
    update_lag_steps: int = 8  # deterministic: decode steps between a batch's completion and its version's load


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
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
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
    eval: EvalConfig = field(default_factory=EvalConfig)


GROUP_SCHEMAS: dict[str, Mapping[str, type]] = {
    "algo": ALGORITHM_CONFIGS,  # declared by the algorithms themselves, read when first asked
    "backend": {"fsdp": FSDPBackendConfig, "megatron": MegatronBackendConfig},
    "rollout": {"vllm": VLLMRolloutConfig, "hf": HFRolloutConfig, "server": ServerRolloutConfig},
    "model": {
        "tiny": ModelConfig, "tiny_sft": ModelConfig, "tiny_vl": ModelConfig, "tiny_vl_sft": ModelConfig,
        "tiny_moe": ModelConfig, "tiny_moe_sft": ModelConfig,
    },
    "reference": {"default": ReferenceConfig},
    "critic": {"default": CriticConfig},
    "teacher": {"default": TeacherConfig},
    "reward_model": {"none": NoRewardModelConfig, "hf": HFRewardModelConfig, "judge": JudgeRewardModelConfig},
    "env": {"none": NoEnvConfig, "python": PythonEnvConfig, "tools": ToolsEnvConfig, "agent": AgentEnvConfig,
            "openenv": OpenEnvEnvConfig, "textarena": TextArenaEnvConfig},
    "data": {"default": DataConfig, "reasoning_gym": DataConfig},
    "logger": {"default": LoggerConfig},
}


def register_configs() -> None:
    """Store the root schema and one `<name>_schema` node per group option, once per process (a
    process that composes many configs, a sweep's or a test session's, would rebuild them each time)."""
    cs = ConfigStore.instance()
    if "config_schema.yaml" in cs.repo:
        return
    cs.store(name="config_schema", node=Config)
    for group, options in GROUP_SCHEMAS.items():
        for name, schema in options.items():
            cs.store(group=group, name=f"{name}_schema", node=schema)
