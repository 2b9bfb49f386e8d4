"""FSDP2 over its own process group: 3 teardown/re-creation cycles change nothing.

Proves what time sharing needs from the FSDP backend (RELIABILITY "time sharing and
communicators"): the process-group registry has the same size after every cycle, the destroyed
group is no longer registered and no FSDP state still caches it, a training step (forward, the
reduce-scatter of gradients, the DTensor grad norm) and a weight export after the cycles give
bitwise the same numbers as without, and a teardown that fails on one rank raises on both.
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_ranks

pytestmark = pytest.mark.dist


def _pg_count() -> int:
    return len(torch.distributed.distributed_c10d._world.pg_map)


def _engine(model_dir):
    from rltrain.backends.fsdp.engine import FSDPEngine
    from rltrain.config.group_options import FSDPBackendConfig
    from rltrain.config.schema import OptimConfig, SafetyConfig

    return FSDPEngine(
        model_dir,
        FSDPBackendConfig(),
        OptimConfig(warmup_steps=0),
        10,
        torch.device("cpu"),
        safety=SafetyConfig(collective_timeout_s=20),
    )


def _step_and_export(eng, rank: int) -> dict:
    from rltrain.data.batch import SequenceBatch

    gen = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(3, 30, (4 + i,), generator=gen).tolist() for i in range(3)]
    completions = [torch.randint(3, 30, (2 + 2 * i,), generator=gen).tolist() for i in range(3)]
    batch = SequenceBatch.from_lists(prompts, completions)
    n_tokens = 2 * float(batch.num_completion_tokens)  # both ranks hold the same counts

    def loss_fn(out, mb):
        return -out.logps.values.sum() / n_tokens, {}

    metrics = eng.train_step([batch], loss_fn)
    return {"metrics": metrics, "weights": {k: v.clone() for k, v in eng.export_weights()}}


def _cycles(rank: int, world: int, model_dir) -> dict:
    import torch.distributed as dist

    plain = _step_and_export(_engine(model_dir), rank)
    eng = _engine(model_dir)
    sizes = [_pg_count()]
    first = eng.groups.group
    rebound = []
    for _ in range(3):
        eng.offload()
        eng.teardown_communicators()
        torn = _pg_count()
        rebound.append(eng.recreate_communicators())
        eng.onload()
        sizes.append(_pg_count())
    old_registered = first in dist.distributed_c10d._world.pg_map
    stale = eng.groups.stale_handles()
    cycled = _step_and_export(eng, rank)

    original = dist.destroy_process_group
    if rank == 1:

        def failing(group=None):
            raise OSError("injected teardown failure")

        dist.destroy_process_group = failing
    try:
        eng.teardown_communicators()
        injected = "no error"
    except RuntimeError as exc:
        injected = str(exc)
    finally:
        dist.destroy_process_group = original
    return dict(
        plain=plain,
        cycled=cycled,
        sizes=sizes,
        torn=torn,
        rebound=rebound,
        old_registered=old_registered,
        stale=stale,
        injected=injected,
    )


def test_fsdp_teardown_recreate_cycles_change_nothing(tiny_cache):
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    model_dir = build_tiny_model_dir(cfg, seed=1)
    results = run_ranks(_cycles, model_dir, timeout_s=150)
    for res in results:
        assert len(set(res["sizes"])) == 1, f"process-group registry size drifted: {res['sizes']}"
        assert res["torn"] == res["sizes"][0] - 1
        assert all(n > 0 for n in res["rebound"]), res["rebound"]
        assert not res["old_registered"] and res["stale"] == []
        assert res["cycled"]["metrics"] == res["plain"]["metrics"]
        for name, tensor in res["plain"]["weights"].items():
            assert torch.equal(tensor, res["cycled"]["weights"][name]), name
        assert "failed on at least one rank" in res["injected"]
