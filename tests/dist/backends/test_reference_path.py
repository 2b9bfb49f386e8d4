"""`reference.path` loads another model as the reference: on two FSDP ranks, the engine the run
builds for the role (`build_engine(ctx, "reference")` with the trainer's `role_dirs`) gives the
log-probabilities, and GRPO's k3 KL to the policy, that transformers gives directly."""

from __future__ import annotations

import pytest
import torch
from helpers import compose_config, direct_completion_logps, run_ranks

pytestmark = pytest.mark.dist

PROMPTS = [[3, 40, 41], [3, 50, 52, 60, 61, 7], [9]]
COMPLETIONS = [[22, 23, 2], [70, 71, 72, 73, 74, 75, 76, 2], [30]]


def _model_dirs(root):
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, cache_dir=str(root))
    return build_tiny_model_dir(cfg, seed=31), build_tiny_model_dir(cfg, seed=32)


def _engine_logps(rank, world, cfg, policy_dir):
    from rltrain.backends import build_engine
    from rltrain.backends.roles import resolve_role_dirs
    from rltrain.config.run_context import RunContext
    from rltrain.data.batch import SequenceBatch
    from rltrain.models.tokenizer import load_tokenizer
    from rltrain.runtime.distributed import DistInfo

    tokenizer = load_tokenizer(str(policy_dir))
    dist_info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    role_dirs = resolve_role_dirs(cfg, policy_dir, tokenizer, rank)
    ctx = RunContext(cfg, policy_dir.parent, dist_info, policy_dir, tokenizer, role_dirs)
    batch = SequenceBatch.from_lists(PROMPTS, COMPLETIONS)
    out = {}
    for role in ("policy", "reference"):
        (scored,) = build_engine(ctx, role, cfg.trainer.max_steps).forward_logps([batch])
        out[role] = scored.logps.values.detach().clone()
    return out, role_dirs


def test_a_reference_path_gives_the_kl_transformers_gives(tiny_cache, tmp_path):
    from rltrain.algos.policy_loss import k3_kl

    policy_dir, other_dir = _model_dirs(tmp_path)
    cfg = compose_config("algo.beta=0.04", f"reference.path={other_dir}", "trainer.nproc=2")
    results = run_ranks(_engine_logps, cfg, policy_dir, nproc=2, timeout_s=240)
    direct_policy, direct_reference = direct_completion_logps(policy_dir, PROMPTS, COMPLETIONS), direct_completion_logps(other_dir, PROMPTS, COMPLETIONS)
    direct_kl = k3_kl(direct_policy, direct_reference)
    assert float(direct_kl.mean()) > 1e-3  # the two models really differ
    for out, role_dirs in results:
        assert role_dirs == {"reference": other_dir.resolve()}
        torch.testing.assert_close(out["policy"], direct_policy, rtol=0, atol=1e-6)
        torch.testing.assert_close(out["reference"], direct_reference, rtol=0, atol=1e-6)
        torch.testing.assert_close(k3_kl(out["policy"], out["reference"]), direct_kl, rtol=0, atol=1e-6)
