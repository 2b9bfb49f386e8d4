"""The options a Hydra group chooses between: one dataclass per option of `backend`, `rollout`,
`reward_model` and `env` (a base per group, a subclass per option), and the `reference` and `critic`
models; each `algo` option is declared in its algorithm's module, read through rltrain.config.algorithms.
Each option's YAML in `conf/<group>/` extends its schema (`<group>/<name>_schema`, stored by
rltrain.config.schema.register_configs). The run's own sections and the root `Config` are in
rltrain.config.schema; docs/configuration.md lists every key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from omegaconf import MISSING

from rltrain.config.choices import choice

RolloutProcess = Literal["colocated", "separate"]  # separate: the engine in a child process (rollout/separate.py)
RolloutQuantization = Literal["none", "fp8"]  # fp8: vLLM quantizes the weights at every load (docs/moe.md)
EnvName = Literal["none", "python", "tools"]  # rltrain/envs
# The weight push's pair group (rltrain/rollout/server/push.py `push_backend`): auto picks NCCL where
# the trainer and a server it did not spawn both run on CUDA, gloo otherwise.
PushBackend = Literal["auto", "gloo", "nccl"]
JudgeApi = Literal["chat", "completions"]  # reward_model=judge: the endpoint it asks (rltrain/rewards/judge)
JudgeScore = Literal["pattern", "yes_probability"]  # reward_model=judge: how a verdict becomes a score
# reward_model=judge's default prompt: a chat judge with a 0-10 scale ending in `Score: N`.
DEFAULT_JUDGE_TEMPLATE = (
    "Rate the answer to the question below from 0 (wrong or useless) to 10 (correct and complete).\n"
    "Question: {{ prompt }}\nAnswer: {{ completion }}\n"
    "{% if reference %}Reference answer: {{ reference }}\n{% endif %}"
    "Reply with one line: Score: N"
)


@dataclass
class BackendConfig:
    name: str = MISSING


@dataclass
class FSDPBackendConfig(BackendConfig):
    name: str = "fsdp"
    reshard_after_forward: bool = True
    # A micro-batch of unrelated sequences is one packed row with document-masked attention
    # (rltrain/backends/fsdp/micro_batches/padding_free.py) instead of a padded rectangle or length buckets.
    padding_free: bool = False
    compile: bool = False  # torch.compile each decoder layer (rltrain/backends/fsdp/compile_layers.py)
    # Sequences that share a prompt (GRPO groups, DPO pairs) are packed one row per prompt, so the
    # prompt is computed once (rltrain/backends/fsdp/micro_batches/shared_prefix.py). Never for MoE models.
    share_prompts: bool = True
    # On one rank, a micro-batch is scored as a few rectangles of similar lengths instead of one
    # padded to its longest row. Never on sharded ranks or for MoE models.
    length_buckets: bool = True
    # Context parallelism: each sequence's tokens split over `cp` consecutive ranks, attention across
    # the split by all-to-all over heads (rltrain/backends/fsdp/context_parallel/, docs/long-sequences.md).
    cp: int = 1


@dataclass
class MegatronBackendConfig(BackendConfig):
    name: str = "megatron"
    tp: int = 1
    pp: int = 1
    # Expert parallelism: a Mixture of Experts' experts split over `ep` data-parallel ranks, tokens
    # sent to them by all-to-all (docs/moe.md, "Expert parallelism (megatron)"); 1 on a dense model.
    ep: int = 1
    # Context parallelism: refused above 1 on this build (megatron-core's needs Transformer Engine;
    # docs/long-sequences.md). The key exists so that the refusal is a sentence, not an unknown key.
    cp: int = 1


@dataclass
class RolloutConfig:
    name: str = MISSING
    seed: int = 0


@dataclass
class VLLMRolloutConfig(RolloutConfig):
    name: str = "vllm"
    process: str = choice("colocated", RolloutProcess)
    kv_cache_gib: float = 1.0  # CPU: the KV-cache budget, at most what max_num_seqs sequences fill (rollout/kv_budget.py; on CUDA, gpu_memory_utilization decides)
    max_num_seqs: int = 256
    max_model_len: int | None = None  # longest prompt + completion; null = the model's own limit
    # vLLM on CUDA (docs/time-sharing-and-sync.md, "vLLM on CUDA"); the CPU build takes none of these:
    gpu_memory_utilization: float = 0.5  # fraction of the GPU the engine may take (weights + KV cache)
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # true: no CUDA graphs (the CPU build always runs eagerly)
    quantization: str = choice("none", RolloutQuantization)  # fp8: vLLM's online fp8 weights, engine in bf16/fp16
    sleep_level: int = 1  # time sharing: 1 keeps the weights in host memory, 2 drops them (resynced)
    bucket_mb: int = 64  # process=separate: shared-memory bucket size of the weight transport
    timeout_s: float = 300.0  # process=separate: bound on every wait for the child (a reply, a bucket)
    start_timeout_s: float = 600.0  # process=separate: bound on the child building its engine
    num_threads: int = 0  # process=separate: the engine's torch threads; 0 = the trainer's (docs/async.md)


@dataclass
class ServersConfig:
    """Where `rollout=server` finds its vLLM API servers (docs/rollout-servers.md)."""

    urls: list[str] = field(default_factory=list)  # base URLs of servers already running (`python -m rltrain.serve`)
    spawn: int = 0  # servers rltrain starts on this machine, each its own process, stopped with the run
    trainer_address: str = "127.0.0.1"  # the address the servers reach the trainer at (the weight push)
    start_timeout_s: float = 600.0  # bound on a spawned server's start, and on a URL's first answer
    push_backend: str = choice("auto", PushBackend)  # the weight push's torch.distributed backend per server


@dataclass
class ServerRolloutConfig(RolloutConfig):
    """vLLM's own OpenAI-compatible API servers, reached over HTTP; weights pushed after every update."""

    name: str = "server"
    servers: ServersConfig = field(default_factory=ServersConfig)
    timeout_s: float = 300.0  # bound on one request, one weight push, and on waiting for a server to come back
    bucket_mb: int = 64  # size of one weight-push bucket
    kv_cache_gib: float = 1.0  # spawned/served, CPU: the KV-cache budget
    max_num_seqs: int = 256  # spawned/served: vLLM's --max-num-seqs
    max_model_len: int | None = None  # spawned/served: longest prompt + completion; null = the model's own limit
    gpu_memory_utilization: float = 0.5  # spawned/served, CUDA: fraction of the GPU the server takes
    num_threads: int = 0  # CPU: each server's torch threads; 0 = all usable cores but one (the API server's)


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
class TeacherConfig:
    """The teacher of on-policy distillation (`algo=distill`): a Hugging Face causal LM directory or Hub
    id sharing the policy's tokenizer, frozen, scoring the tokens the policy samples (rltrain/algos/distill.py)."""

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
class JudgeRewardModelConfig(RewardModelConfig):
    """A generative judge asked through a Jinja prompt (rltrain/rewards/judge): `path` served by a vLLM
    API server of the run, or `url`, any OpenAI-compatible endpoint. `batch_size`: prompts per request
    (api=completions); `max_length`: the served engine's longest prompt + verdict. docs/rewards-and-roles.md."""

    name: str = "judge"
    url: str | None = None  # an OpenAI-compatible endpoint's base, e.g. http://host:8000/v1; null: path, served here
    model: str | None = None  # the model name sent in each request; null: the served path (required with url)
    api_key_env: str | None = None  # the NAME of the environment variable holding the endpoint's key
    api: str = choice("chat", JudgeApi)  # chat: /chat/completions, the prompt as one user message; completions: raw text
    template: str = DEFAULT_JUDGE_TEMPLATE  # Jinja over the row's columns, prompt, completion, reference
    reference_column: str = "solution"  # the column the template sees as `reference` (null where a row lacks it)
    score: str = choice("pattern", JudgeScore)
    pattern: str = r"Score:\s*(-?\d+(?:\.\d+)?)"  # score=pattern: its last match's first group, divided by max_score
    max_score: float = 10.0  # score=pattern: the scale's top; scores are clipped to [0, 1]
    yes_token: str = "Yes"  # score=yes_probability: the first verdict token's probability of this token
    max_tokens: int = 256  # verdict tokens per request (score=yes_probability asks for one)
    temperature: float = 0.0
    concurrency: int = 16  # requests in flight at once per rank
    timeout_s: float = 60.0  # bound on one request; past it (after the retries) the sample scores 0, counted
    retries: int = 2  # more tries of a request that timed out, could not connect or got a 5xx (counted)
    start_timeout_s: float = 600.0  # path: bound on the served engine's start
    kv_cache_gib: float = 0.5  # path, CPU: the served engine's KV-cache budget
    gpu_memory_utilization: float = 0.3  # path, CUDA: the fraction of the GPU the served engine takes


@dataclass
class EnvConfig:
    """Multi-turn episodes (docs/environments.md). `none`: single-turn RL, one completion per sample
    scored by `reward.fns`. `python`: `cls` (`pkg.module:Class`) is a user environment with
    `reset(**row)` and `step(text)`; one instance per episode, run in worker processes that a timeout kills.
    `tools`: `tools` (`pkg.module:function` each) are offered to the model, called in those workers, and
    the episode's last reply is scored by `reward.fns`. `agent`: `agent` (`pkg.module:function`) is
    the user's agent, `run(client, row) -> reward`, calling the run's OpenAI-compatible endpoint
    (docs/agents.md). `openenv`: an OpenEnv environment, `cls` hosted in those workers or at `url`
    (docs/environments.md, "OpenEnv")."""

    name: str = MISSING
    cls: str | None = None
    tools: list[str] = field(default_factory=list)  # env=tools: the functions offered to the model
    describe_tools: bool = True  # env=tools: list the tools in a text prompt (a chat prompt gets them from its template)
    max_turns: int = 4  # model turns per episode
    max_tokens_per_turn: int | None = None  # one turn's generation budget; null = algo.max_new_tokens
    max_total_tokens: int = 256  # an episode's completion: every model turn and observation
    timeout_s: float | None = 30.0  # bound on one reset or step; a failed episode scores reward.on_failure
    workers: int = 1  # worker processes per rank that host the episodes
    max_concurrency: int = 256  # environment calls (episodes' resets and steps, tool calls) in flight at once per rank
    agent: str | None = None  # env=agent: the user's agent, `run(client, row)` returning the episode's reward
    chat_template: str | None = None  # env=agent: the Jinja template the endpoint renders messages with; null = the tokenizer's
    url: str | None = None  # env=openenv: a running OpenEnv server (instead of env.cls, a class the run hosts)
    action: str | None = None  # env=openenv: `pkg.module:function`, the reply's text -> the environment's Action


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
class AgentEnvConfig(EnvConfig):
    name: str = "agent"


@dataclass
class OpenEnvEnvConfig(EnvConfig):
    name: str = "openenv"


@dataclass
class TextArenaEnvConfig(EnvConfig):
    """`env=textarena env.game=ID`: a TextArena game (rltrain/envs/textarena, docs/environments.md). A
    two-player game is self-play unless `opponent` names a fixed one: `pkg.module:fn` (scripted) or an
    OpenAI-compatible base URL (its model `opponent_model`); the policy then plays `policy_seat`."""

    name: str = "textarena"
    game: str | None = None  # a TextArena env id, e.g. GuessTheNumber-v0, TicTacToe-v0
    opponent: str | None = None  # null: self-play (two-player games); pkg.module:fn or http(s)://HOST/v1
    opponent_model: str | None = None  # the model name sent to an opponent URL
    policy_seat: int = 0  # with an opponent: the seat the policy plays (0 moves first)
