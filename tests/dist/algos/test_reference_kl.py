"""A reference model of its own (`reference.path`, here `RunContext.role_dirs["reference"]`)
gives exactly the KL a direct transformers computation gives: the policy's `policy/kl` (k3, the
mean over completion tokens) from the real `Learner` equals the one computed from two plain
`AutoModelForCausalLM`s on the same sequences."""

from __future__ import annotations

import pytest
import torch
from helpers import compose_config, direct_completion_logps, run_ranks

pytestmark = pytest.mark.dist


def _model_dir(seed: int):
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    return build_tiny_model_dir(cfg, seed=seed)


PROMPTS = [[3, 7, 4], [5, 9], [6, 6, 8, 2]]
COMPLETIONS = [[10, 11, 12], [13], [14, 15]]


def _learner_kl(rank, world, policy_dir, reference_dir):
    from pathlib import Path

    from rltrain.config.run_context import RunContext
    from rltrain.algos.rl.batch_layout import BatchLayout
    from rltrain.algos.rl.experience import Experience
    from rltrain.rewards.scoring import Failures
    from rltrain.algos.rl.update import Learner, MiniBatchUpdate, ParityProbe, make_policy_loss
    from rltrain.backends import build_engine
    from rltrain.data.batch import SequenceBatch
    from rltrain.runtime.distributed import DistInfo

    cfg = compose_config("algo=grpo", "algo.beta=0.1")
    dist_info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    ctx = RunContext(cfg=cfg, run_dir=Path("."), dist=dist_info, model_dir=Path(policy_dir), tokenizer=None,
                     role_dirs={"reference": Path(reference_dir)})
    steps = cfg.trainer.max_steps
    policy, reference = build_engine(ctx, "policy", steps), build_engine(ctx, "reference", steps)
    parity = ParityProbe()
    layout = BatchLayout(len(PROMPTS), 1, rank, world)
    learner = Learner(policy, MiniBatchUpdate(layout, 1, 1, 8, 0), make_policy_loss(cfg.algo, parity), parity, True, reference=reference)
    batch = SequenceBatch.from_lists(PROMPTS, COMPLETIONS)
    engine = policy.forward_logps([batch])[0].logps
    counts = torch.tensor([float(batch.num_completion_tokens), float(len(batch)), 0.0, float(batch.num_completion_tokens)], dtype=torch.float64)
    empty = torch.zeros(0, dtype=torch.float64)
    exp = Experience(rows=[], completions=[], batch=batch, engine_logps=engine, rewards_by_fn={}, reward_failures=Failures(), scores_B=empty,
                     global_scores=empty, counts=counts, time_rollout=0.0)
    learner.score(exp)
    metrics = learner.update_policy(exp, torch.zeros(len(batch)))
    return metrics["policy/kl"], exp.ref_logps.values.clone()


def test_reference_path_kl_equals_a_direct_transformers_computation(tiny_cache):
    policy_dir, reference_dir = _model_dir(31), _model_dir(32)
    ((kl, ref_logps),) = run_ranks(_learner_kl, policy_dir, reference_dir, nproc=1, timeout_s=240)
    policy_direct, ref_direct = direct_completion_logps(policy_dir, PROMPTS, COMPLETIONS), direct_completion_logps(reference_dir, PROMPTS, COMPLETIONS)
    torch.testing.assert_close(ref_logps, ref_direct, rtol=1e-5, atol=1e-6)
    delta = ref_direct - policy_direct
    kl_direct = float((torch.exp(delta) - delta - 1).mean())
    assert kl_direct > 1e-3  # two different models: a KL worth measuring
    assert kl == pytest.approx(kl_direct, rel=1e-5, abs=1e-7)
