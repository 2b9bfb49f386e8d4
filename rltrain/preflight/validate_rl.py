"""The checks only RL runs need: multi-turn environments (`env`), generating ahead
(`placement.max_staleness`) and a MoE's router replay (`algo.router_replay`). rltrain/preflight/validate.py calls them with the rest before any model
is built; docs/environments.md and docs/async.md say what each refusal protects.
"""

from __future__ import annotations

from pathlib import Path

from rltrain.config.algorithms import names_where, spec_of
from rltrain.config.group_choice import as_option
from rltrain.config.group_options import ServerRolloutConfig, VLLMRolloutConfig
from rltrain.config.schema import Config
from rltrain.preflight.textarena import validate_textarena
from rltrain.preflight.world import model_experts
from rltrain.runtime.errors import UserError


def _algo_list(names: list[str]) -> str:
    """["grpo", "ppo"] -> "algo=grpo or algo=ppo"."""
    return " or ".join(f"algo={name}" for name in names)


def validate_env(cfg: Config) -> None:
    """`env=python`, `env=tools`, `env=agent` and `env=openenv` (docs/environments.md, docs/agents.md): what this release runs multi-turn, and in-range numbers."""
    env = cfg.env
    if env.name not in ("python", "openenv") and env.cls is not None:
        raise UserError(f"env.cls={env.cls!r} is set but env={env.name} does not use it: add env=python to use it.")
    if env.name != "openenv" and (env.url is not None or env.action is not None):
        key = "env.url" if env.url is not None else "env.action"
        raise UserError(f"{key} is set but env={env.name} does not use it: add env=openenv to use it.")
    if env.name != "tools" and list(env.tools):
        raise UserError(f"env.tools={list(env.tools)} is set but env={env.name} does not use it: add env=tools to use them.")
    if env.name != "agent" and (env.agent is not None or env.chat_template is not None):
        key = "env.agent" if env.agent is not None else "env.chat_template"
        raise UserError(f"{key} is set but env={env.name} does not use it: add env=agent to use it.")
    if env.name == "none":
        return
    if env.name == "agent" and (not env.agent or ":" not in env.agent):
        raise UserError(f"env=agent needs env.agent=package.module:function, your agent (got {env.agent!r}).")
    template = env.chat_template
    if template is not None and "{" not in template and not Path(template).expanduser().is_file():
        raise UserError(f"env.chat_template={template!r} is neither a Jinja template nor a file: give the template or its path.")
    if env.name == "python" and (not env.cls or ":" not in env.cls):
        raise UserError(f"env=python needs env.cls=package.module:Class, your environment class (got {env.cls!r}).")
    if env.name == "openenv":
        validate_openenv(cfg)
    if env.name == "tools":
        if not list(env.tools):
            raise UserError("env=tools needs env.tools=[package.module:function,...], the functions the model may call.")
        for path in env.tools:
            if ":" not in path:
                raise UserError(f"env.tools entry {path!r} must be package.module:function.")
    if not spec_of(cfg.algo.name).rewards:
        raise UserError(
            f"env={env.name} trains with {_algo_list(names_where(lambda s: s.rewards))}; algo={cfg.algo.name} cannot: "
            "it scores no episodes."
        )
    if cfg.algo.dynamic_sampling:
        raise UserError(
            f"algo.dynamic_sampling=true with env={env.name}: dynamic sampling draws more prompts for single-turn "
            "completions; episodes are not resampled. Set algo.dynamic_sampling=false."
        )
    if cfg.algo.overlong_buffer > 0:
        raise UserError(
            f"algo.overlong_buffer={cfg.algo.overlong_buffer} with env={env.name}: the overlong penalty measures one "
            "completion against algo.max_new_tokens, and an episode's completion spans many turns and observations. "
            "Set algo.overlong_buffer=0, or bound episodes with env.max_total_tokens."
        )
    if env.name == "python" and (list(cfg.reward.fns) or cfg.reward_model.name != "none"):
        raise UserError(
            "env=python takes its rewards from the environment's step() (summed over the episode); reward.fns and "
            "reward_model are not called. Remove them, or score inside step()."
        )
    if env.name == "agent" and (list(cfg.reward.fns) or cfg.reward_model.name != "none"):
        raise UserError(
            "env=agent takes its rewards from what the agent returns; reward.fns and reward_model are not called. "
            "Remove them, or score inside the agent."
        )
    if env.name == "openenv" and (list(cfg.reward.fns) or cfg.reward_model.name != "none"):
        raise UserError(
            "env=openenv takes its rewards from the environment's step results (summed over the episode); reward.fns and "
            "reward_model are not called. Remove them, or score inside the environment."
        )
    for key in ("max_turns", "max_total_tokens", "workers", "max_concurrency"):
        if getattr(env, key) < 1:
            raise UserError(f"env.{key}={getattr(env, key)} must be at least 1.")
    if env.max_tokens_per_turn is not None and env.max_tokens_per_turn < 1:
        raise UserError(f"env.max_tokens_per_turn={env.max_tokens_per_turn} must be at least 1 (null: algo.max_new_tokens).")
    if env.timeout_s is not None and env.timeout_s < 0:
        raise UserError(f"env.timeout_s={env.timeout_s} must be positive (seconds), or 0 / null for no limit.")
    if env.name == "textarena":
        validate_textarena(cfg)


def validate_openenv(cfg: Config) -> None:
    """`env=openenv` (docs/environments.md, "OpenEnv"): one source of episodes, and the package installed."""
    from rltrain.envs.openenv.check import require_openenv

    env = cfg.env
    if bool(env.cls) == bool(env.url):
        raise UserError(
            f"env=openenv needs one of env.cls=package.module:Environment (the run hosts it) or env.url=http://host:port "
            f"(a running OpenEnv server); got env.cls={env.cls!r} and env.url={env.url!r}."
        )
    if env.cls and ":" not in env.cls:
        raise UserError(f"env.cls={env.cls!r} must be package.module:Environment.")
    if env.url and not str(env.url).startswith(("http://", "https://")):
        raise UserError(f"env.url={env.url!r} must be a server's base URL, such as http://127.0.0.1:8000.")
    if env.action is not None and ":" not in env.action:
        raise UserError(f"env.action={env.action!r} must be package.module:function (the reply's text -> the Action).")
    require_openenv()


def validate_servers(cfg: Config) -> None:
    """`rollout=server` (docs/rollout-servers.md): its fleet and what it cannot do."""
    rollout = as_option("rollout", cfg.rollout, ServerRolloutConfig)
    if rollout is None:
        return
    if cfg.placement.time_sharing:
        raise UserError(
            "rollout=server with placement.time_sharing=true: the servers are processes of their own (on this machine or "
            "others) that keep their memory, so there is nothing to take turns on. Set placement.time_sharing=false, or use "
            "rollout=vllm to share one device between the engine and the trainer."
        )
    servers = rollout.servers
    if servers.spawn < 0 or (servers.spawn == 0 and not servers.urls):
        raise UserError(
            f"rollout=server needs servers: rollout.servers.spawn={servers.spawn} and rollout.servers.urls={list(servers.urls)}. "
            "Set rollout.servers.spawn=N (servers started on this machine) and/or rollout.servers.urls=[http://host:port] "
            "(servers started with `python -m rltrain.serve <the run's overrides>`)."
        )
    bad = [u for u in servers.urls if not str(u).startswith(("http://", "https://"))]
    if bad:
        raise UserError(f"rollout.servers.urls has {bad}: each entry is a base URL such as http://10.0.0.2:8000.")
    for key in ("timeout_s", "bucket_mb", "max_num_seqs", "kv_cache_gib"):
        if getattr(rollout, key) <= 0:
            raise UserError(f"rollout.{key}={getattr(rollout, key)} must be positive.")


def validate_staleness(cfg: Config) -> None:
    """`placement.max_staleness` (docs/async.md): the engines and loops that can generate ahead."""
    k = cfg.placement.max_staleness
    if k < 0:
        raise UserError(f"placement.max_staleness={k} must be 0 (synchronous) or a number of policy versions >= 1.")
    if k == 0:
        return
    if not spec_of(cfg.algo.name).generates:
        raise UserError(
            f"placement.max_staleness={k} overlaps generation with training; algo={cfg.algo.name} generates nothing. "
            f"Use {_algo_list(names_where(lambda s: s.generates))}, or placement.max_staleness=0."
        )
    if cfg.placement.time_sharing:
        raise UserError(
            f"placement.max_staleness={k} with placement.time_sharing=true: time sharing makes the engine and the trainer "
            "take turns on one device, so nothing can overlap. Set placement.time_sharing=false (the engine keeps its "
            "memory beside the trainer's), or placement.max_staleness=0."
        )
    vllm = as_option("rollout", cfg.rollout, VLLMRolloutConfig)
    process = vllm.process if vllm is not None else None
    beside_trainer = cfg.rollout.name == "server" or process == "separate"  # servers run beside it by construction
    if not beside_trainer:
        raise UserError(
            f"placement.max_staleness={k} needs an engine that runs beside the trainer: rollout=vllm "
            f"rollout.process=separate (the engine in its own process). rollout={cfg.rollout.name}"
            + (f" rollout.process={process}" if process else "")
            + " shares the trainer's process and threads, so it cannot overlap. Add rollout=vllm rollout.process=separate, "
            "or set placement.max_staleness=0."
        )


def validate_router_replay(cfg: Config) -> None:
    """`algo.router_replay=true` (docs/moe.md, "Router replay"): a MoE, an engine that records its
    routing (rollout=hf; rollout=vllm on vLLM's CPU build, in process or separate, whole batches;
    rollout=server with rltrain's servers on the CPU build, batched requests), single-turn
    completions; either backend."""
    if not bool(cfg.algo.get("router_replay", False)):
        return
    experts = model_experts(cfg)
    if experts is not None and experts[1] == 0:
        raise UserError(
            f"algo.router_replay=true needs a Mixture-of-Experts model; this one names no experts ({experts[0]}). Router "
            "replay routes each sampled token to the experts the rollout engine chose for it, and a dense model has no "
            "router. Set algo.router_replay=false, or train a MoE (model=tiny_moe, or model.path of one). docs/moe.md."
        )
    if cfg.rollout.name == "server":
        _validate_server_router_replay(cfg)
    if cfg.rollout.name == "vllm":
        _validate_vllm_router_replay(cfg)
    if cfg.env.name != "none":
        raise UserError(
            f"algo.router_replay=true with env={cfg.env.name}: a multi-turn episode's sequences do not carry the engine's "
            "routing yet, so nothing would be replayed. Use single-turn GRPO or PPO, or algo.router_replay=false. "
            "docs/moe.md."
        )


def _validate_vllm_router_replay(cfg: Config) -> None:
    """rollout=vllm records the routing on vLLM's CPU build (rltrain/rollout/vllm_routing.py), per
    `generate` call or, in the separate engine's in-flight loop, per request
    (rltrain/rollout/inflight_routing.py): not on a GPU."""
    import torch

    if torch.cuda.is_available():
        raise UserError(
            "algo.router_replay=true with rollout=vllm on a GPU: rltrain records vLLM's routing by tapping the routers "
            "of vLLM's CPU model runner in process, which CUDA vLLM's graphs and worker processes bypass, and vLLM's "
            "own enable_return_routed_experts is not wired yet (it cannot be tested here). Use rollout=hf, or "
            "algo.router_replay=false (rollout/mismatch_kl still measures the mismatch). docs/moe.md."
        )


def _validate_server_router_replay(cfg: Config) -> None:
    """rollout=server records the routing in rltrain's own API servers on vLLM's CPU build, per
    request of its batch route (rltrain/rollout/server/batch_route.py; the in-flight stream sends a
    MoE's groups there too): not a server this trainer spawns on a GPU. A URL-given server that
    returns no record stops the run at its first batch (rollout/server/batch_requests.py)."""
    import torch

    if torch.cuda.is_available() and int(cfg.rollout.servers.spawn) > 0:
        raise UserError(
            "algo.router_replay=true with rollout=server spawning servers on a GPU: rltrain records a MoE's routing by "
            "tapping the routers of vLLM's CPU model runner inside its server, which CUDA vLLM's graphs bypass, and "
            "vLLM's own enable_return_routed_experts is not wired yet (it cannot be tested here). Point "
            "rollout.servers.urls at servers on vLLM's CPU build, use rollout=hf, or set algo.router_replay=false "
            "(rollout/mismatch_kl still measures the mismatch). docs/moe.md."
        )
