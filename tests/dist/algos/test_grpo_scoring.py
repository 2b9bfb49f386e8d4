"""GRPO's on-policy shortcut: scoring in the training pass equals a separate scoring pass.

With one iteration and one mini-batch, GRPO takes the old log-probabilities, the entropy and the
train/rollout parity from the training pass itself instead of a no-grad forward over the batch
first. Both ways run here through the RL `Learner` (score, then update the policy) on fresh engines
built from the same weights and a hand-made `Experience`:
the loss, every metric (parity included) and the updated parameters must agree, on 1 and 2 FSDP
ranks and on Megatron with two pipeline stages (where only the last stage sees the loss).
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_ranks

pytestmark = pytest.mark.dist

PROMPTS, GROUP = 3, 4


def _model_dir():
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    return build_tiny_model_dir(cfg, seed=21)


def _grpo_update(rank, world, model_dir, backend, fused):
    from rltrain.algos.rl.batch_layout import BatchLayout
    from rltrain.algos.rl.experience import Experience
    from rltrain.algos.grpo import GRPOConfig
    from rltrain.algos.rl.update import Learner, MiniBatchUpdate, ParityProbe, make_policy_loss
    from rltrain.config.group_options import FSDPBackendConfig, MegatronBackendConfig
    from rltrain.config.schema import OptimConfig
    from rltrain.data.batch import SequenceBatch
    from rltrain.data.ragged import Ragged
    from rltrain.data.sharding import rank_slice
    from rltrain.rewards.scoring import Failures

    torch.manual_seed(0)
    cpu = torch.device("cpu")
    optim = OptimConfig(lr=1e-2, max_grad_norm=1.0)
    if backend == "megatron-pp2":
        from rltrain.backends.megatron.engine import MegatronEngine

        policy = MegatronEngine(model_dir, MegatronBackendConfig(tp=1, pp=2), optim, 10, cpu)
    else:
        from rltrain.backends.fsdp.engine import FSDPEngine

        policy = FSDPEngine(model_dir, FSDPBackendConfig(), optim, 10, cpu)
    cfg = GRPOConfig(prompts_per_step=PROMPTS, group_size=GROUP, max_new_tokens=9)
    layout = BatchLayout(PROMPTS, GROUP, policy.rank, policy.world_size)
    parity = ParityProbe()
    learner = Learner(policy, MiniBatchUpdate(layout, 1, 1, 2, 0), make_policy_loss(cfg, parity), parity, fused)

    # This rank's prompts and GROUP ragged completions each; the "engine" log-probabilities are
    # the trainer's own plus a known offset, so the parity metrics have something to measure.
    mine = rank_slice(list(range(PROMPTS)), policy.rank, policy.world_size)
    prompts = [[3 + g, 7, 4 + g] for g in mine]
    seqs = [(i, _completion(g, k)) for i, g in enumerate(mine) for k in range(GROUP)]
    batch = SequenceBatch.from_lists([prompts[i] for i, _ in seqs], [c for _, c in seqs])
    exact = policy.forward_logps([batch])[0].logps if len(batch) else None
    engine = exact.with_values(exact.values + 1e-4 * (exact.seq_ids() % 3).float()) if exact is not None else Ragged.from_lengths(torch.zeros(0), [])
    adv = torch.linspace(-1.0, 1.0, PROMPTS * GROUP)[layout.offset : layout.offset + len(batch)]
    all_tokens = sum(len(_completion(g, k)) for g in range(PROMPTS) for k in range(GROUP))
    counts = torch.tensor([float(all_tokens), float(PROMPTS * GROUP), 0.0, float(all_tokens)], dtype=torch.float64)
    empty = torch.zeros(0, dtype=torch.float64)
    exp = Experience(rows=[], completions=[], batch=batch, engine_logps=engine, rewards_by_fn={}, reward_failures=Failures(), scores_B=empty,
                     global_scores=empty, counts=counts, time_rollout=0.0)
    learner.score(exp)
    metrics = learner.update_policy(exp, adv)
    params = torch.cat([t.flatten() for _, t in sorted(policy.export_weights())])
    return metrics, params


def _completion(prompt: int, k: int) -> list[int]:
    return [5 + (prompt + k) % 6] * (1 + (k * 3 + prompt) % 7)


@pytest.mark.parametrize("backend, nproc", [("fsdp", 1), ("fsdp", 2), ("megatron-pp2", 2)])
def test_training_pass_scoring_equals_a_scoring_pass(tiny_cache, backend, nproc):
    model_dir = _model_dir()
    fused = run_ranks(_grpo_update, model_dir, backend, True, nproc=nproc, timeout_s=240)
    separate = run_ranks(_grpo_update, model_dir, backend, False, nproc=nproc, timeout_s=240)
    for (m_fused, p_fused), (m_sep, p_sep) in zip(fused, separate):
        assert set(m_fused) == set(m_sep)
        for key in ("loss", "policy/entropy", "policy/kl", "policy/clipfrac", "grad_norm"):
            assert m_fused[key] == pytest.approx(m_sep[key], rel=1e-5, abs=1e-7), key
        # the engine's log-probabilities were the trainer's plus 0, 1e-4 or 2e-4
        assert m_fused["rollout/logprob_diff_max"] == pytest.approx(2e-4, rel=1e-2)
        assert m_sep["rollout/logprob_diff_max"] == pytest.approx(2e-4, rel=1e-2)
        assert m_fused["rollout/logprob_diff_mean"] == pytest.approx(m_sep["rollout/logprob_diff_mean"], rel=1e-3)
        assert 0.5e-4 < m_fused["rollout/logprob_diff_mean"] < 2e-4
        assert m_fused["policy/entropy"] > 0.0
        torch.testing.assert_close(p_fused, p_sep, rtol=1e-5, atol=1e-6)


def test_micro_batches_cover_the_rank_with_the_most_prompts():
    """3 prompts x 4 completions on 2 ranks: rank 0 holds 8 sequences, not ceil(12 / 2) = 6."""
    from rltrain.algos.rl.batch_layout import BatchLayout

    layout = BatchLayout(PROMPTS, GROUP, rank=0, world_size=2)
    assert layout.micro_batches_per_rank(0, PROMPTS * GROUP, 2) == 4
    assert layout.micro_batches_per_rank(0, 6, 2) == 3  # first mini-batch of two: all on rank 0
    assert layout.micro_batches_per_rank(6, 12, 2) == 2  # second: 2 on rank 0, 4 on rank 1
    assert BatchLayout(PROMPTS, GROUP, rank=1, world_size=2).offset == 8
    assert BatchLayout(PROMPTS, GROUP, rank=0, world_size=1).micro_batches_per_rank(0, PROMPTS * GROUP, 128) == 1
