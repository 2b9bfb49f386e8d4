"""PPO's numbers do not depend on how the batch is laid out: 1 rank vs 2 ranks, and micro-batches
of 1 vs 8 sequences, give the same advantages, losses, metrics and updated weights (policy and
critic), through the real `Learner` and `ppo_advantages` on FSDP engines built from the same weights
and a hand-made experience (TRL's invariance tests, for PPO as for GRPO)."""

from __future__ import annotations

import pytest
import torch
from helpers import compose_config, run_ranks

pytestmark = pytest.mark.dist

PROMPTS, GROUP = 3, 2


def _model_dir():
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    return build_tiny_model_dir(cfg, seed=23)


def _completion(prompt: int, k: int) -> list[int]:
    return [5 + (prompt + 2 * k) % 6] * (1 + (k * 3 + prompt) % 5)


def _ppo_step(rank, world, model_dir, mb_size, overrides):
    from pathlib import Path

    from rltrain.config.run_context import RunContext
    from rltrain.algos.rl.batch_layout import BatchLayout
    from rltrain.algos.rl.experience import Experience
    from rltrain.rewards.scoring import Failures
    from rltrain.algos.ppo import make_value_loss, ppo_advantages
    from rltrain.algos.rl.update import Learner, MiniBatchUpdate, ParityProbe, make_policy_loss
    from rltrain.backends import build_engine
    from rltrain.data.batch import SequenceBatch
    from rltrain.data.sharding import rank_slice
    from rltrain.runtime.distributed import DistInfo

    torch.manual_seed(0)
    cfg = compose_config("algo=ppo", "optim.lr=1e-2", *overrides)
    dist_info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    ctx = RunContext(cfg=cfg, run_dir=Path("."), dist=dist_info, model_dir=Path(model_dir), tokenizer=None)
    steps = cfg.trainer.max_steps
    policy, critic = build_engine(ctx, "policy", steps), build_engine(ctx, "critic", steps)
    a = cfg.algo
    layout = BatchLayout(PROMPTS, GROUP, policy.rank, policy.world_size)
    parity = ParityProbe()
    update = MiniBatchUpdate(layout, a.mini_batches, a.num_iterations, mb_size, 0)
    fused = a.mini_batches == 1 and a.num_iterations == 1
    learner = Learner(policy, update, make_policy_loss(a, parity), parity, fused, critic=critic)

    mine = rank_slice(list(range(PROMPTS)), policy.rank, policy.world_size)
    seqs = [([3 + g, 7, 4 + g], _completion(g, k)) for g in mine for k in range(GROUP)]
    batch = SequenceBatch.from_lists([p for p, _ in seqs], [c for _, c in seqs])
    engine = policy.forward_logps([batch])[0].logps
    global_scores = torch.tensor([0.1 * ((3 * i) % 7) for i in range(PROMPTS * GROUP)], dtype=torch.float64)
    scores_B = global_scores[layout.offset : layout.offset + len(batch)]
    n_tokens = sum(len(_completion(g, k)) for g in range(PROMPTS) for k in range(GROUP))
    counts = torch.tensor([float(n_tokens), float(PROMPTS * GROUP), 0.0, float(n_tokens)], dtype=torch.float64)
    exp = Experience(rows=[], completions=[], batch=batch, engine_logps=engine, rewards_by_fn={}, reward_failures=Failures(), scores_B=scores_B,
                     global_scores=global_scores, counts=counts, time_rollout=0.0)
    learner.score(exp)
    advantages = ppo_advantages(exp, a, policy.world_size)
    assert advantages.returns is not None
    metrics = {
        **advantages.metrics,
        **learner.update_policy(exp, advantages.adv),
        **learner.update_critic(exp, advantages.returns, make_value_loss(a.vf_clip)),
    }
    values_after = critic.forward_values([batch])[0]
    params = torch.cat([t.flatten() for _, t in sorted(policy.export_weights())])
    return metrics, params, [v.clone() for v in values_after.split()], layout.offset


KEYS = ("loss", "grad_norm", "policy/clipfrac", "policy/approx_kl", "adv/mean", "adv/std", "critic/values_mean",
        "critic/explained_variance", "critic/value_loss", "critic/vf_clipfrac", "critic/grad_norm")


@pytest.mark.parametrize("overrides", [[], ["algo.mini_batches=2", "algo.num_iterations=2"]], ids=["on-policy", "2x2"])
def test_ppo_one_rank_equals_two_ranks_and_any_micro_batch_size(tiny_cache, overrides):
    model_dir = _model_dir()
    (one,) = run_ranks(_ppo_step, model_dir, 8, overrides, nproc=1, timeout_s=300)
    (one_small,) = run_ranks(_ppo_step, model_dir, 1, overrides, nproc=1, timeout_s=300)
    two = run_ranks(_ppo_step, model_dir, 2, overrides, nproc=2, timeout_s=300)
    ref_metrics, ref_params, ref_values, _ = one
    assert ref_metrics["critic/value_loss"] > 0 and ref_metrics["adv/std"] > 0
    for metrics, params, values, offset in [one_small, *two]:
        for key in KEYS:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-6), key
        # Adam divides by sqrt(v): on entries whose gradient is ~0 a summation-order difference of
        # 1e-9 moves the step by ~1e-6, still 1e-4 of the lr-sized update every other entry takes.
        torch.testing.assert_close(params, ref_params, rtol=1e-4, atol=2e-5)
        # The critic's values after its update, per sequence: functions of parameters that agree to the
        # tolerance above, so near-zero values agree to ~1e-6 absolute, not relative (seen on other CPUs).
        for i, seq_values in enumerate(values):
            torch.testing.assert_close(seq_values, ref_values[offset + i], rtol=1e-5, atol=1e-5)
