"""The sequence-level and masking rollout corrections (`seq_tis`, `seq_mask`, `geo_mask`, `icepop`)
against values by hand, and against an independent padded implementation written from the papers'
formulas (TRL's `vllm_importance_sampling_mode` and verl's rollout-correction definitions) on
random ragged batches; the mismatch metrics by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rltrain.algos.rollout_correction import (
    CorrectionBands,
    clamped_tokens,
    correction,
    correction_metrics,
    mismatch_kl_sum,
    ratio_max,
)
from rltrain.data.ragged import Ragged


def _ragged(values, lengths):
    return Ragged.from_lengths(torch.tensor(values, dtype=torch.float32), lengths)


OLD = _ragged([-1.0, -2.0, -0.5, -3.0], [2, 2])
ENGINE = _ragged([-1.5, -1.0, -0.5, -0.2], [2, 2])  # old - engine = [0.5, -1.0 | 0.0, -2.8]
SEQ_LOG = [-0.5, -2.8]  # per-sequence sums


def test_seq_tis_broadcasts_each_sequences_truncated_ratio():
    weights, keep = correction(OLD, ENGINE, "seq_tis", 0.5, 2.0)
    assert keep is None
    # exp(-0.5) = 0.607 -> 0.5 (truncated); exp(-2.8) = 0.061 stays
    assert weights.values.tolist() == pytest.approx([0.5, 0.5, math.exp(-2.8), math.exp(-2.8)])


def test_seq_mask_keeps_the_ratio_inside_its_bounds_and_zeroes_the_rest():
    weights, keep = correction(OLD, ENGINE, "seq_mask", 2.0, 2.0, bands=CorrectionBands(is_floor=0.1))
    assert keep.tolist() == [True, False]  # exp(-2.8) = 0.061 < 0.1
    assert weights.values.tolist() == pytest.approx([math.exp(-0.5)] * 2 + [0.0, 0.0])
    m = correction_metrics(weights, keep, 4, global_tokens=4.0, global_seqs=2.0)
    assert float(m["rollout/masked_frac"]) == 0.5 and float(m["rollout/masked_token_frac"]) == 0.5


def test_geo_mask_keeps_a_sequence_whose_geometric_mean_ratio_is_in_the_band():
    # geometric means: exp(-0.25) = 0.78 and exp(-1.4) = 0.25
    _, keep = correction(OLD, ENGINE, "geo_mask", 2.0, 2.0, bands=CorrectionBands(geo_low=0.7, geo_high=1.2))
    assert keep.tolist() == [True, False]
    weights, keep_tight = correction(OLD, ENGINE, "geo_mask", 2.0, 2.0)  # the default band [0.999, 1.001]
    assert weights is None and keep_tight.tolist() == [False, False]


def test_icepop_zeroes_each_token_whose_ratio_leaves_the_band():
    # token ratios: e^0.5 = 1.65, e^-1 = 0.37, 1, e^-2.8 = 0.06; band [0.5, 5]
    weights, keep = correction(OLD, ENGINE, "icepop", 2.0, 2.0)
    assert keep is None
    assert weights.values.tolist() == pytest.approx([math.exp(0.5), 0.0, 1.0, 0.0])
    m = correction_metrics(weights, None, 4, global_tokens=4.0, global_seqs=2.0)
    assert float(m["rollout/masked_token_frac"]) == 0.5 and float(m["rollout/masked_frac"]) == 0.0


def test_mismatch_kl_and_the_largest_ratio_by_hand():
    log_rho = [0.5, -1.0, 0.0, -2.8]
    k3 = sum(math.exp(x) - 1 - x for x in log_rho)
    assert float(mismatch_kl_sum(OLD, ENGINE)) == pytest.approx(k3, rel=1e-6)
    assert float(ratio_max(OLD, ENGINE, "tis")) == pytest.approx(math.exp(0.5))
    assert float(ratio_max(OLD, ENGINE, "seq_tis")) == pytest.approx(math.exp(-0.5))
    assert float(ratio_max(OLD, ENGINE, "geo_mask")) == pytest.approx(math.exp(-0.25))
    assert float(ratio_max(OLD.like_empty(), ENGINE.like_empty(), "tis")) == 0.0


def test_observation_tokens_are_left_out_of_the_sequence_ratio():
    sampled = Ragged.from_lengths(torch.tensor([1.0, 0.0, 1.0, 1.0]), [2, 2])
    weights, _ = correction(OLD, ENGINE, "seq_tis", 5.0, 2.0, sampled=sampled)
    assert weights.values.tolist() == pytest.approx([math.exp(0.5)] * 2 + [math.exp(-2.8)] * 2)
    _, keep = correction(OLD, ENGINE, "geo_mask", 2.0, 2.0, sampled=sampled, bands=CorrectionBands(geo_low=0.2, geo_high=1.7))
    assert keep.tolist() == [True, True]  # geometric means e^0.5 (one sampled token) and e^-1.4


@pytest.mark.parametrize("bad", [
    ("seq_mask", 2.0, CorrectionBands(is_floor=3.0), "rollout_is_floor"),
    ("geo_mask", 2.0, CorrectionBands(geo_low=1.1), "rollout_geo_band"),
    ("icepop", 2.0, CorrectionBands(icepop_high=0.9), "rollout_icepop_band"),
    ("seq_tis", 0.0, CorrectionBands(), "rollout_is_cap"),
])
def test_bounds_that_would_drop_an_exact_match_are_errors(bad):
    mode, cap, bands, key = bad
    with pytest.raises(ValueError, match=key):
        correction(OLD, ENGINE, mode, cap, 2.0, bands=bands)


# --- against an independent padded implementation ----------------------------------------------


def _padded_reference(old_BT, engine_BT, mask_BT, mode, cap, floor, low, high):
    """[B, T] weights written from the definitions, on padded tensors with a mask (TRL's layout):
    sequence modes sum the masked log-ratios, token modes use them one by one."""
    diff_BT = (old_BT - engine_BT) * mask_BT
    if mode == "seq_tis":
        return torch.exp(diff_BT.sum(-1, keepdim=True)).clamp(max=cap).expand_as(diff_BT)
    if mode == "seq_mask":
        rho = torch.exp(diff_BT.sum(-1, keepdim=True))
        return rho.masked_fill((rho < floor) | (rho > cap), 0.0).expand_as(diff_BT)
    if mode == "geo_mask":
        geo = torch.exp(diff_BT.sum(-1, keepdim=True) / mask_BT.sum(-1, keepdim=True).clamp(min=1))
        return ((geo >= low) & (geo <= high)).float().expand_as(diff_BT)
    rho = torch.exp(diff_BT)  # icepop
    return rho.masked_fill((rho < low) | (rho > high), 0.0)


@pytest.mark.parametrize("mode", ["seq_tis", "seq_mask", "geo_mask", "icepop"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_mode_equals_the_padded_reference_on_random_ragged_batches(mode, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (6,), generator=gen).tolist()
    n = sum(lengths)
    old = Ragged.from_lengths(-torch.rand(n, generator=gen) * 3, lengths)
    engine = Ragged.from_lengths(old.values + torch.randn(n, generator=gen) * 0.3, lengths)
    cap, floor, low, high = 1.5, 0.4, 0.8, 1.25
    bands = CorrectionBands(is_floor=floor, geo_low=low, geo_high=high, icepop_low=low, icepop_high=high)
    weights, keep = correction(old, engine, mode, cap, 2.0, bands=bands)
    old_BT, mask_BT = old.to_padded()
    engine_BT, _ = engine.to_padded()
    want_BT = _padded_reference(old_BT, engine_BT, mask_BT.float(), mode, cap, floor, low, high)
    if mode == "geo_mask":
        assert weights is None
        torch.testing.assert_close(keep.float(), want_BT[:, 0])
    else:
        got_BT, _ = weights.to_padded()
        torch.testing.assert_close(got_BT * mask_BT, want_BT * mask_BT)


def _k3_series(x: float) -> float:
    """k3 = e^x - 1 - x by its Taylor series, in float64, for |x| <= 1e-2 (independent of expm1)."""
    return x * x / 2 + x**3 / 6 + x**4 / 24 + x**5 / 120 + x**6 / 720


@pytest.mark.parametrize("gap", [1e-6, -1e-6, 1e-5, 1e-4, -1e-4, 3e-4, 1e-3, -1e-2])
def test_the_mismatch_kl_of_tiny_log_ratios_is_not_rounded_away(gap):
    # fp32 engines and trainers differ by such gaps: `exp(x) - 1 - x` in float32 read 0 up to
    # |x| = 1e-4 and 34% low at 3e-4. The float32 log-probabilities' exact gap is the reference's x.
    old = _ragged([-1.0, -2.5, -0.25], [3])
    engine = old.with_values(old.values - gap)
    exact_x = (old.values.double() - engine.values.double()).tolist()
    k3 = sum(_k3_series(x) for x in exact_x)
    assert float(mismatch_kl_sum(old, engine)) == pytest.approx(k3, rel=1e-3)


ENGINE_FLOOR = -9999.0  # vLLM's log-probability of a token it gives no probability (rollout/server/batch_route.py)


@pytest.mark.parametrize("mode", ["none", "tis", "mask", "seq_tis", "seq_mask", "geo_mask", "icepop"])
def test_an_engine_log_probability_at_the_floor_keeps_every_metric_finite(mode):
    from types import SimpleNamespace

    from rltrain.algos.grpo import GRPOConfig
    from rltrain.algos.rl.update import ParityProbe, PolicyBatchInputs, make_policy_loss
    from rltrain.backends.base import PolicyOutput
    from rltrain.data.batch import SequenceBatch

    batch = SequenceBatch.from_lists([[1, 2], [3]], [[4, 5, 6], [7, 8]])
    old = _ragged([-1.0, -2.0, -0.5, -3.0, -0.7], [3, 2])
    engine = old.with_values(torch.tensor([-1.0, ENGINE_FLOOR, -0.5, -3.0, -0.7]))
    batch.loss_inputs = PolicyBatchInputs(adv=torch.tensor([1.0, -1.0]), engine_logps=engine, old_logps=old,
                                          measure_parity=True, global_tokens=5.0, global_seqs=2.0)
    cfg = SimpleNamespace(**{**vars(GRPOConfig()), "rollout_correction": mode})
    probe = ParityProbe()
    loss, metrics = make_policy_loss(cfg, probe)(PolicyOutput(old.with_values(old.values.clone().requires_grad_()), None), batch)
    assert math.isfinite(float(loss.detach()))
    for key, value in metrics.items():
        assert math.isfinite(float(value)), (key, float(value))
    assert float(metrics["rollout/clamped_tokens"]) == 1.0
    # one token's log ratio 9997 read as 20: k3 = e^20 - 21 over 5 tokens; the ratio at most e^20
    assert float(metrics["rollout/mismatch_kl"]) == pytest.approx((math.exp(20.0) - 21.0) / 5, rel=1e-9)
    assert 1.0 < probe.max_ratio <= math.exp(20.0) * (1 + 1e-12)


def test_clamped_tokens_counts_the_sampled_tokens_past_the_bound():
    old = _ragged([-1.0, -2.0, -0.5, -3.0], [2, 2])
    engine = old.with_values(torch.tensor([ENGINE_FLOOR, -2.0, float("nan"), -3.0 - 25.0]))
    assert float(clamped_tokens(old, engine)) == 3.0
    sampled = Ragged.from_lengths(torch.tensor([0.0, 1.0, 1.0, 1.0]), [2, 2])  # the first is an observation
    assert float(clamped_tokens(old, engine, sampled)) == 2.0
    assert float(clamped_tokens(old, old)) == 0.0


class _SummingEngine:
    """A stand-in policy engine: `train_step` calls the loss on each micro-batch with the batch's
    old log-probabilities as the model's and sums the metrics, as a real engine reduces them."""

    world_size = 1

    def train_step(self, micro, loss_fn, with_entropy=False):
        from rltrain.backends.base import PolicyOutput

        sums: dict[str, float] = {}
        for mb in micro:
            if len(mb):
                _, metrics = loss_fn(PolicyOutput(mb.loss_inputs.old_logps, None), mb)
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
        return sums


@pytest.mark.parametrize("mini_batches, iterations", [(1, 1), (2, 1), (2, 3), (4, 2)])
def test_the_step_logs_the_batchs_count_of_clamped_tokens(mini_batches, iterations):
    """Metrics are averaged over a step's updates; the count is the whole batch's, once, however
    the batch is split into mini-batches and passed over."""
    from types import SimpleNamespace

    from rltrain.algos.grpo import GRPOConfig
    from rltrain.algos.rl.batch_layout import BatchLayout
    from rltrain.algos.rl.update import Learner, MiniBatchUpdate, ParityProbe, make_policy_loss
    from rltrain.data.batch import SequenceBatch

    batch = SequenceBatch.from_lists([[1], [2], [3], [4]], [[5, 6], [7], [8, 9], [10]])
    old = _ragged([-1.0, -2.0, -0.5, -3.0, -0.7, -0.2], [2, 1, 2, 1])
    engine = old.with_values(torch.tensor([ENGINE_FLOOR, ENGINE_FLOOR, -0.5, -3.0, -0.7, ENGINE_FLOOR]))
    exp = SimpleNamespace(batch=batch, engine_logps=engine, old_logps=old, entropy=None, ref_logps=None, episode_of=None,
                          counts=torch.tensor([6.0, 4.0, 0.0, 6.0, 0.0], dtype=torch.float64))
    probe = ParityProbe()
    update = MiniBatchUpdate(BatchLayout(4, 1, 0, 1), mini_batches, iterations, micro_batch_size=1, token_budget=0)
    learner = Learner(_SummingEngine(), update, make_policy_loss(GRPOConfig(), probe), probe, fused=False)  # type: ignore[arg-type]
    out = learner.update_policy(exp, torch.tensor([1.0, -1.0, 0.5, -0.5]))  # type: ignore[arg-type]
    assert out["rollout/clamped_tokens"] == 3.0
    assert math.isfinite(out["rollout/mismatch_kl"]) and out["rollout/is_ratio_max"] == pytest.approx(math.exp(20.0))
