"""GRPO from the command line: metrics, rollout/trainer parity on every supported architecture,
several ranks, the transformers fallback, a reference model, and reward plug-ins."""

from __future__ import annotations

import json
import textwrap

import pytest
from cli import GRPO_HF_RUN, GRPO_RUN, GRPO_RUN_2_RANKS, QUICK, rltrain, train_rows

pytestmark = pytest.mark.e2e

SMALL = ["algo=grpo", "algo.prompts_per_step=4", "algo.group_size=4", "data.num_eval=8", *QUICK]
# Where the rollout engine plays no part in what is checked (the KL term, a reward function's
# errors), the transformers engine: it starts in a fraction of vLLM's time on CPU.
SMALL_HF = [*SMALL, "rollout=hf"]
STEP_KEYS = {
    "loss", "reward/mean", "reward/std", "reward/addition_reward", "rollout/response_length_mean",
    "rollout/truncated_fraction", "policy/clipfrac", "policy/kl", "policy/entropy", "rollout/tokens_per_s",
    "time/rollout", "time/train", "time/sync", "rollout/logprob_diff_max", "rollout/logprob_diff_mean",
}


@pytest.mark.parametrize(
    "model",
    [
        None,  # the default tiny model (qwen2, tied embeddings): the shared GRPO_RUN, 4 steps
        ["model.arch=qwen2", "model.tie_word_embeddings=false"],
        ["model.arch=llama", "model.attention_bias=false", "model.tie_word_embeddings=true"],
        ["model.arch=llama", "model.attention_bias=true", "model.tie_word_embeddings=false"],
    ],
    ids=["qwen2-tied", "qwen2-untied", "llama-nobias-tied", "llama-bias-untied"],
)
def test_rollout_logprobs_match_the_trainer_every_step(shared_runs, tmp_path, model):
    if model is None:
        run_dir, steps = shared_runs.get(*GRPO_RUN), 4
    else:
        # 2 steps: the second generates with the weights synced after the first update.
        run_dir, steps = tmp_path / "run", 2
        rltrain(*SMALL, "trainer.max_steps=2", *model, run_dir=run_dir, timeout=400)
    rows = train_rows(run_dir)
    assert len(rows) == steps
    for row in rows:
        assert STEP_KEYS <= set(row), STEP_KEYS - set(row)
        assert row["rollout/logprob_diff_max"] < 1e-3
        assert 0.0 <= row["reward/mean"] <= 1.0


def test_two_ranks_each_generate_their_share(shared_runs):
    run_dir = shared_runs.get(*GRPO_RUN_2_RANKS)
    rows = train_rows(run_dir)
    assert len(rows) == 2 and all(r["rollout/logprob_diff_max"] < 1e-3 for r in rows)


def test_transformers_rollout_fallback(shared_runs):
    run_dir = shared_runs.get(*GRPO_HF_RUN)
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in train_rows(run_dir))


def test_kl_to_a_reference_model(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain(*SMALL_HF, "algo.beta=0.05", "algo.loss_agg=seq_mean_token_mean", "trainer.max_steps=2", run_dir=run_dir,
            timeout=400)  # step 2 comes after an update
    rows = train_rows(run_dir)
    assert rows[0]["policy/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any update
    assert rows[-1]["policy/kl"] > 0.0


def _user_module(tmp_path, body: str) -> dict:
    (tmp_path / "myrewards.py").write_text(textwrap.dedent(body))
    return {"PYTHONPATH": str(tmp_path)}


def test_user_reward_function_on_user_data(tiny_cache, tmp_path):
    env = _user_module(tmp_path, """
        def short_answer(prompts, completions, target, **kw):
            return [1.0 if c.strip() == t else 0.1 for c, t in zip(completions, target)]
    """)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}*2=", "target": str(2 * a)}) + "\n" for a in range(30)))
    run_dir = tmp_path / "run"
    rltrain(*SMALL, f"data.path={data}", "reward.fns=[myrewards:short_answer]", "reward.weights=[2.0]",
            "trainer.max_steps=2", run_dir=run_dir, env=env, timeout=400)
    row = train_rows(run_dir)[0]
    assert "reward/short_answer" in row
    assert row["reward/mean"] == pytest.approx(2.0 * row["reward/short_answer"], rel=1e-6)


@pytest.mark.parametrize(
    "body, message",
    [
        ("def bad(prompts, completions, **kw):\n    raise KeyError('oops')\n", "myrewards:bad"),
        ("def bad(prompts, completions, **kw):\n    return [0.0]\n", "returned 1 rewards"),
    ],
    ids=["raises", "wrong-length"],
)
def test_broken_reward_function_gets_a_clear_error(tiny_cache, tmp_path, body, message):
    env = _user_module(tmp_path, body)
    proc = rltrain(*SMALL_HF, "reward.fns=[myrewards:bad]", "trainer.max_steps=1", run_dir=tmp_path / "run", env=env,
                   check=False, timeout=400)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
