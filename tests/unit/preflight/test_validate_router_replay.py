"""`algo.router_replay=true` where it cannot run is refused before any model is built, one
paragraph naming the key and the fix (rltrain/preflight/validate_rl.py, docs/moe.md "Router replay")."""

from __future__ import annotations

import pytest
from helpers import compose_config

from rltrain.preflight.validate import validate
from rltrain.runtime.errors import UserError


@pytest.fixture(autouse=True)
def _not_under_torchrun(monkeypatch) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["model=tiny", "rollout=hf"], ["needs a Mixture-of-Experts model", "model=tiny_moe"]),
    ],
)
def test_router_replay_where_it_cannot_run_is_refused(overrides, names) -> None:
    with pytest.raises(UserError) as info:
        validate(compose_config("algo=grpo", "algo.router_replay=true", *overrides))
    for name in names:
        assert name in str(info.value), str(info.value)


def test_router_replay_on_a_moe_with_an_engine_that_records_passes() -> None:
    validate(compose_config("algo=grpo", "algo.router_replay=true", "model=tiny_moe", "rollout=hf"))
    validate(compose_config("algo=ppo", "algo.router_replay=true", "model=tiny_moe", "rollout=hf", "trainer.nproc=2"))
    validate(compose_config("algo=grpo", "algo.router_replay=true", "model=tiny_moe", "rollout=hf", "backend=megatron",
                            "backend.ep=2", "trainer.nproc=2"))
    validate(compose_config("algo=grpo", "algo.router_replay=true", "model=tiny_moe", "rollout=vllm"))
    validate(compose_config(
        "algo=grpo", "algo.router_replay=true", "model=tiny_moe", "rollout=vllm", "rollout.process=separate",
        "placement.max_staleness=1",
    ))
    for stream in ("false", "true"):  # the separate engine's in-flight loop records per request (inflight_routing.py)
        validate(compose_config(
            "algo=grpo", "algo.router_replay=true", "model=tiny_moe", "rollout=vllm", "rollout.process=separate",
            "placement.max_staleness=1", "placement.weight_update=in_flight", f"placement.stream={stream}",
        ))
    validate(compose_config("algo=grpo", "algo.router_replay=true", "model=tiny_moe", "rollout=server",
                            "rollout.servers.spawn=1", "trainer.nproc=2", "placement.max_staleness=1"))
    validate(compose_config("algo=grpo", "algo.router_replay=true", "model=tiny_moe", "rollout=server",
                            "rollout.servers.spawn=1", "placement.max_staleness=1", "placement.weight_update=in_flight",
                            "placement.stream=true"))


def test_router_replay_with_vllm_on_a_gpu_is_refused(monkeypatch) -> None:
    """The record taps vLLM's CPU runner (rltrain/rollout/vllm_routing.py); CUDA vLLM would return none."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(UserError) as info:
        validate(compose_config("algo=grpo", "algo.router_replay=true", "model=tiny_moe", "rollout=vllm"))
    for name in ("rollout=vllm on a GPU", "enable_return_routed_experts", "rollout=hf"):
        assert name in str(info.value), str(info.value)


def test_router_replay_with_servers_spawned_on_a_gpu_is_refused(monkeypatch) -> None:
    """A server's record taps vLLM's CPU runner in its worker (docs/moe.md, "Recording in a server");
    a URL-given server that returns none stops the run at its first batch instead (test_vllm_routing.py)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(UserError) as info:
        validate(compose_config("algo=grpo", "algo.router_replay=true", "model=tiny_moe", "rollout=server",
                                "rollout.servers.spawn=1"))
    for name in ("rollout=server spawning servers on a GPU", "rollout.servers.urls", "algo.router_replay=false"):
        assert name in str(info.value), str(info.value)
