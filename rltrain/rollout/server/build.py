"""`rollout=server`'s entry in the rollout registry: the run's fleet from its config (every rank builds
it; with generating ahead, a gloo group for the ranks' version loads). docs/rollout-servers.md.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from rltrain.config.group_options import ServerRolloutConfig
from rltrain.config.run_context import RunContext
from rltrain.rollout.server.fleet import ServerFleetEngine
from rltrain.rollout.server.roster import share_urls


def build_engine(ctx: RunContext) -> ServerFleetEngine:
    """The run's fleet (registry key `server`)."""
    import torch.distributed as dist

    from rltrain.runtime.precision import resolve_precision

    cfg: ServerRolloutConfig = ctx.cfg.rollout
    several = dist.is_initialized() and dist.get_world_size() > 1
    share = share_urls if several else None
    loads_group = None
    if several and ctx.cfg.placement.max_staleness >= 1:  # every rank builds the engine: new_group is collective
        loads_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=ctx.cfg.safety.collective_timeout_s))
    return ServerFleetEngine(
        cfg, ctx.model_dir, dtype=resolve_precision(ctx.cfg.trainer.precision, ctx.dist.device).compute_dtype_name,
        rank=ctx.dist.rank, cuda=ctx.dist.device.type == "cuda", log_dir=Path(ctx.run_dir), urls_from_rank0=share,
        loads_group=loads_group, router_replay=bool(ctx.cfg.algo.get("router_replay", False)),  # an RL algorithm's key
    )
