"""env=agent's several sequences per episode through the RL `Learner` (docs/agents.md, "What trains").

An episode may train more than one sequence (a rewritten history, a fork), each at its episode's
position in the batch layout and with its episode's advantage; ranks then hold different numbers of
sequences and agree on their micro-batches. Checked by an invariance: every sequence given twice
(`episode_of` naming the same episode for both copies) changes no token-mean loss, metric or updated
parameter, on 2 FSDP ranks that hold 8 and 4 episodes (16 and 8 sequences), with one mini-batch (the
fused scoring) and with two (a separate scoring pass; each copy in its episode's mini-batch).
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


def _update(rank, world, model_dir, mini_batches, twice):
    from rltrain.algos.rl.batch_layout import BatchLayout
    from rltrain.algos.rl.experience import Experience
    from rltrain.algos.grpo import GRPOConfig
    from rltrain.algos.rl.update import Learner, MiniBatchUpdate, ParityProbe, make_policy_loss
    from rltrain.backends.fsdp.engine import FSDPEngine
    from rltrain.config.group_options import FSDPBackendConfig
    from rltrain.config.schema import OptimConfig
    from rltrain.data.batch import SequenceBatch
    from rltrain.data.sharding import rank_slice
    from rltrain.rewards.scoring import Failures

    torch.manual_seed(0)
    policy = FSDPEngine(model_dir, FSDPBackendConfig(), OptimConfig(lr=1e-2, max_grad_norm=1.0), 10, torch.device("cpu"))
    cfg = GRPOConfig(prompts_per_step=PROMPTS, group_size=GROUP, max_new_tokens=9, mini_batches=mini_batches, loss_agg="token_mean")
    layout = BatchLayout(PROMPTS, GROUP, policy.rank, policy.world_size)
    parity = ParityProbe()
    learner = Learner(policy, MiniBatchUpdate(layout, mini_batches, 1, 2, 0), make_policy_loss(cfg, parity), parity, mini_batches == 1)

    mine = rank_slice(list(range(PROMPTS)), policy.rank, policy.world_size)
    prompts = [[3 + g, 7, 4 + g] for g in mine]
    seqs = [(i, [5 + (g + k) % 6] * (1 + (k * 3 + g) % 7)) for i, g in enumerate(mine) for k in range(GROUP)]
    episodes = len(seqs)
    episode_of = list(range(episodes)) * (2 if twice else 1)
    batch = SequenceBatch.from_lists([prompts[seqs[e][0]] for e in episode_of], [seqs[e][1] for e in episode_of])
    engine = policy.forward_logps([batch])[0].logps
    adv_episode = torch.linspace(-1.0, 1.0, PROMPTS * GROUP)[layout.offset : layout.offset + episodes]
    adv = adv_episode[torch.tensor(episode_of)]
    counts = torch.zeros(4, dtype=torch.float64)
    empty = torch.zeros(0, dtype=torch.float64)
    exp = Experience(rows=[], completions=[], batch=batch, engine_logps=engine, rewards_by_fn={}, reward_failures=Failures(),
                     scores_B=empty, global_scores=empty, counts=counts, time_rollout=0.0, episode_of=episode_of if twice else None)
    learner.score(exp)
    metrics = learner.update_policy(exp, adv)
    params = torch.cat([t.flatten() for _, t in sorted(policy.export_weights())])
    return len(batch), metrics, params


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_every_sequence_twice_trains_as_every_sequence_once(tiny_cache, mini_batches):
    model_dir = _model_dir()
    once = run_ranks(_update, model_dir, mini_batches, False, nproc=2, timeout_s=240)
    twice = run_ranks(_update, model_dir, mini_batches, True, nproc=2, timeout_s=240)
    assert [n for n, _, _ in once] == [8, 4] and [n for n, _, _ in twice] == [16, 8]
    for (_, m_once, p_once), (_, m_twice, p_twice) in zip(once, twice, strict=True):
        for key in ("loss", "policy/entropy", "grad_norm"):
            assert m_twice[key] == pytest.approx(m_once[key], rel=1e-5, abs=1e-7), key
        torch.testing.assert_close(p_twice, p_once, rtol=1e-5, atol=1e-6)
