"""The pairwise preference algorithms (rltrain/algos/preference.py) on a fake engine: which
engines each builds (SimPO and ORPO no reference, DPO one), what a step hands the engine, and how
held-out preference accuracy is decided."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import compose_config

from rltrain.algos import dpo, orpo, preference, simpo
from rltrain.backends.base import PolicyOutput
from rltrain.config.algorithms import ALGORITHMS
from rltrain.config.run_context import RunContext
from rltrain.data.preference_data import PreferenceData, PreferencePair, SkipCounts
from rltrain.data.ragged import Ragged


class FakeEngine:
    """Every completion token has log-probability `logp_per_token[len(completion)]`, so a
    completion's score depends on its length only; the step runs `loss_fn` on each micro-batch."""

    rank, world_size = 0, 1

    def __init__(self, role: str) -> None:
        self.role = role
        self.logp_per_token = {1: -1.0, 2: -0.75, 3: -0.9}
        self.losses: list[float] = []

    def _output(self, mb) -> PolicyOutput:
        lens = mb.completion_lens().tolist()
        values = torch.cat([torch.full((n,), self.logp_per_token[n]) for n in lens])
        return PolicyOutput(Ragged.from_lengths(values, lens))

    def forward_logps(self, micro_batches, with_entropy: bool = False):
        return [self._output(mb) for mb in micro_batches]

    def train_step(self, micro_batches, loss_fn, with_entropy: bool = False):
        sums: dict[str, float] = {"loss": 0.0}
        for mb in micro_batches:
            loss, metrics = loss_fn(self._output(mb), mb)
            sums["loss"] += float(loss)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        return sums

    def base_weights(self):
        return None


PAIRS = [PreferencePair([5, 6], [7, 8], [9]), PreferencePair([5], [7], [8, 9, 10]), PreferencePair([6], [7, 8], [9])]


@pytest.fixture
def built(monkeypatch):
    """Build an algorithm on the fake engine and three pairs; returns (algorithm, roles built)."""
    roles: list[str] = []

    def fake_build_engine(ctx, role, max_steps):
        roles.append(role)
        return FakeEngine(role)

    monkeypatch.setattr(preference, "build_engine", fake_build_engine)
    monkeypatch.setattr(dpo, "build_reference", lambda ctx, policy, steps: (fake_build_engine(ctx, "reference", steps),) * 2)
    monkeypatch.setattr(preference, "build_preference_data", lambda *a: PreferenceData(PAIRS, PAIRS, [], SkipCounts()))
    monkeypatch.setattr(preference, "load_processor", lambda *a: None)  # no model directory: a text-only model

    def build(name: str, *overrides: str):
        cfg = compose_config(f"algo={name}", "trainer.global_batch_size=3", "trainer.micro_batch_size=2", *overrides)
        ctx = RunContext(cfg, run_dir=None, dist=SimpleNamespace(device="cpu", is_main=True), model_dir=None, tokenizer=None)  # type: ignore[arg-type]
        cls = {"dpo": dpo.DPO, "simpo": simpo.SimPO, "orpo": orpo.ORPO}[name]
        return cls(ctx), roles

    return build


@pytest.mark.parametrize("name", ["simpo", "orpo"])
def test_reference_free_objectives_build_the_policy_only(built, name):
    algorithm, roles = built(name)
    assert roles == ["policy"]
    assert ALGORITHMS[name].reference == "never" and not ALGORITHMS[name].builds_reference(algorithm.algo_cfg)


def test_dpo_builds_its_reference_and_starts_at_log_2(built):
    algorithm, roles = built("dpo")
    assert roles == ["policy", "reference"]
    metrics = algorithm.train_step(1)
    assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference
    assert metrics["pairs"] == 3.0


def test_reference_free_accuracy_compares_per_token_means(built):
    """Summed, pair 2's chosen (-1) beats its rejected (3 x -0.9); per token it loses (-1 < -0.9).
    Pairs 1 and 3: chosen -0.75 per token against rejected -1: won."""
    for name in ("simpo", "orpo"):
        algorithm, _ = built(name)
        assert algorithm.evaluate(0) == {"eval/dpo_accuracy": pytest.approx(2 / 3)}


def test_a_simpo_step_is_the_mean_of_its_pair_losses(built):
    algorithm, _ = built("simpo", "algo.beta=2.0", "algo.gamma=1.0")
    metrics = algorithm.train_step(1)
    margins = [-0.75 + 1.0, -1.0 + 0.9, -0.75 + 1.0]  # mean chosen - mean rejected, pairs in stream order
    want = sum(-math.log(1 / (1 + math.exp(-(2.0 * m - 1.0)))) for m in margins) / 3
    assert metrics["loss"] == pytest.approx(want, rel=1e-6)
    assert metrics["dpo/accuracy"] == pytest.approx(2 / 3)


def test_an_orpo_step_adds_the_chosen_nll_per_token(built):
    algorithm, _ = built("orpo", "algo.lambda_=0")
    metrics = algorithm.train_step(1)
    chosen_tokens = sum(len(p.chosen) for p in PAIRS)
    want_nll = -(2 * -0.75 + 1 * -1.0 + 2 * -0.75) / chosen_tokens
    assert metrics["loss"] == pytest.approx(want_nll, rel=1e-6)
    assert metrics["orpo/nll"] == pytest.approx(want_nll, rel=1e-6)
    assert metrics["orpo/odds_ratio_loss"] > 0
