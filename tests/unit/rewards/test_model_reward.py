"""The reward model scores prompt + completion exactly as transformers does, and joins the reward
functions as `model` with its weight (the functions in their workers, the model in the trainer's
process) under the same empty-slice rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import compose_config

from rltrain.config.schema import ModelConfig
from rltrain.models.tiny_reward import build_tiny_reward_model_dir
from rltrain.rewards.scoring import RewardScorer, build_reward_fns
from rltrain.rewards.worker_call import WORKER_CALL

SMALL = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
PROMPTS = ["12+34=", "7+8=", "1+1=", "99+1=", "5+5="]
COMPLETIONS = ["46", "15 and more text", "", "100", "ten"]


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory) -> Path:
    return build_tiny_reward_model_dir(tmp_path_factory.mktemp("rm") / "reward", seed=11, cfg=SMALL)


def _direct_scores(path: Path) -> list[float]:
    """Each text alone (no padding) through transformers' own sequence classifier."""
    from transformers import AutoModelForSequenceClassification

    from rltrain.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p, c in zip(PROMPTS, COMPLETIONS):
            ids = tokenizer(p + c, return_tensors="pt")
            out.append(float(model(**ids).logits[0, 0]))
    return out


def test_scores_equal_transformers_and_join_the_builtin_reward_by_weight(reward_dir):
    cfg = compose_config(
        "reward_model=hf", f"reward_model.path={reward_dir}", "reward_model.weight=0.5", "reward_model.batch_size=2"
    )
    fns = build_reward_fns(cfg, torch.device("cpu"))
    assert [(rf.name, rf.weight) for rf in fns] == [("addition_reward", 1.0), ("model", 0.5)]
    scorer = RewardScorer(fns, cfg.reward, cfg.safety.collective_timeout_s)
    assert scorer.pool is not None and scorer.pool.paths == [WORKER_CALL, "rltrain.rewards.builtin:addition_reward"]  # not the model
    answers = ["46", "15", "2", "100", "10"]
    try:
        per_fn, failures = scorer.score(PROMPTS, COMPLETIONS, {"answer": answers}, groups=[0, 1, 2, 3, 4])
    finally:
        scorer.close()
    assert failures.timeouts == failures.errors == 0
    direct = _direct_scores(reward_dir)
    assert per_fn["model"] == pytest.approx(direct, abs=1e-5)
    assert len(set(per_fn["model"])) == len(PROMPTS)  # the texts really are told apart
    assert per_fn["addition_reward"][0] == pytest.approx(1.0)


def test_the_model_alone_rewards_a_user_dataset(reward_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1="}\n')
    cfg = compose_config(f"data.path={data}", "reward_model=hf", f"reward_model.path={reward_dir}")
    fns = build_reward_fns(cfg, torch.device("cpu"))
    assert [rf.name for rf in fns] == ["model"]
    scorer = RewardScorer(fns, cfg.reward, cfg.safety.collective_timeout_s)
    assert scorer.pool is None  # nothing to run in a worker
    assert scorer.score([], [], {}, groups=[])[0] == {"model": []}  # a rank with no completions calls nothing


def test_long_texts_keep_their_end(reward_dir):
    """Truncation drops the beginning: the classifier scores at the last token."""
    from rltrain.rewards.model_reward import SequenceClassifierReward

    short = SequenceClassifierReward(reward_dir, torch.device("cpu"), torch.float32, batch_size=4, max_length=5)
    full = SequenceClassifierReward(reward_dir, torch.device("cpu"), torch.float32, batch_size=4, max_length=64)
    assert short(["xxxxxxxxxx"], ["12345"]) == pytest.approx(full(["12345"], [""]), abs=1e-5)


def test_a_replica_peer_loads_no_reward_model_but_names_the_same_series(reward_dir):
    # A model-parallel replica's lead scores and sends its peers the scores (rltrain/algos/rl/builder.py).
    cfg = compose_config("reward_model=hf", f"reward_model.path={reward_dir}", "reward_model.weight=0.5")
    lead = build_reward_fns(cfg, torch.device("cpu"))
    peer = build_reward_fns(cfg, torch.device("cpu"), scores=False)
    assert [(rf.name, rf.weight, rf.reads_images) for rf in peer] == [(rf.name, rf.weight, rf.reads_images) for rf in lead]
    assert lead[1].device_model is not None and peer[1].device_model is None  # nothing loaded, nothing to move aside
    with pytest.raises(RuntimeError, match="only the replica's lead scores"):
        peer[1].fn(PROMPTS, COMPLETIONS)
