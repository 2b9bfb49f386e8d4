"""The embedded default learns: each algorithm's default command reaches its target.

These are the product's headline promises, run as a new user types them. Only what changes no
training step is set: the run directory, W&B off, evaluation once at the end instead of every
`trainer.eval_every` steps (the held-out numbers asserted are the final ones either way) and no
mid-run checkpoints. The long ones (each default's full length, and GRPO and PPO from the SFT start
raising held-out accuracy) are `slow` (`make test-all`); `make test` keeps one short run per
algorithm that proves it learns at all, with margins about half of what 3 seeds x 1 and 2 threads
showed (docs/testing.md, "What learns in `make test`").
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cli import SFT_RUN, python, read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

# Same training as the default command: these only skip intermediate evaluation and checkpoints.
SAME_TRAINING = ["logger.wandb.mode=disabled", "trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=lines"]


def test_sft_learns_at_all_over_the_shared_run(shared_runs):
    """Six steps from the random tiny model: the loss falls (the SFT start's accuracy is the slow test)."""
    losses = [r["loss"] for r in train_rows(shared_runs.get(*SFT_RUN))]
    assert len(losses) == 6
    assert statistics.mean(losses[-2:]) < statistics.mean(losses[:2]) - 0.1


@pytest.mark.slow
def test_sft_default_reaches_heldout_accuracy(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=sft", *SAME_TRAINING, run_dir=run_dir, timeout=900)
    final = [r for r in read_metrics(run_dir) if "eval/accuracy" in r][-1]
    assert final["step"] == 1500  # the default trainer.max_steps of algo=sft
    assert final["eval/accuracy"] >= 0.8


def test_dpo_learns_at_all_in_60_steps(tiny_cache, tmp_path):
    """The default DPO command cut to 60 steps: the loss leaves log 2 and held-out preferences beat
    chance (3 seeds x 1-2 threads: last-10 loss 0.35-0.51, preference accuracy 0.745-0.91)."""
    run_dir = tmp_path / "run"
    rltrain("algo=dpo", "trainer.max_steps=60", *SAME_TRAINING, run_dir=run_dir, timeout=600)
    losses = [r["loss"] for r in train_rows(run_dir)]
    assert len(losses) == 60
    assert statistics.mean(losses[-10:]) < math.log(2) - 0.1
    final = [r for r in read_metrics(run_dir) if "eval/dpo_accuracy" in r][-1]
    assert final["step"] == 60 and final["eval/dpo_accuracy"] >= 0.6


@pytest.mark.slow
def test_dpo_default_reaches_heldout_preference_accuracy(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=dpo", *SAME_TRAINING, run_dir=run_dir, timeout=900)
    final = [r for r in read_metrics(run_dir) if "eval/dpo_accuracy" in r][-1]
    assert final["step"] == 200
    assert final["eval/dpo_accuracy"] >= 0.9
    assert "eval/accuracy" in final  # the greedy answer accuracy is reported next to it


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "overrides", [["algo=simpo"], ["algo=orpo"], ["algo=dpo", "algo.loss=ipo"], ["algo=rm"]], ids=["simpo", "orpo", "ipo", "rm"]
)
def test_preference_objective_reaches_heldout_preference_accuracy(tiny_cache, tmp_path, overrides, seed):
    """Each objective's default command (its conf/algo defaults; IPO with DPO's): held-out
    preference accuracy >= 0.9 after 200 steps (docs/algorithms.md records the measured numbers);
    the reward model's is how often its reward ranks the held-out chosen completion first."""
    run_dir = tmp_path / "run"
    rltrain(*overrides, f"trainer.seed={seed}", *SAME_TRAINING, run_dir=run_dir, timeout=900)
    key = "eval/rm_accuracy" if overrides == ["algo=rm"] else "eval/dpo_accuracy"
    final = [r for r in read_metrics(run_dir) if key in r][-1]
    assert final["step"] == 200
    assert final[key] >= 0.9


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_kto_learns_from_unpaired_labels(tiny_cache, tmp_path, seed):
    """`python -m rltrain algo=kto trainer.seed=S` (the built-in pairs unpaired, from the SFT start,
    200 steps): held-out preference accuracy reaches the issue's 0.85 (measured: 0.99 or more on
    seeds 0 and 1; docs/algorithms.md, "KTO on unpaired labels")."""
    run_dir = tmp_path / "run"
    rltrain("algo=kto", f"trainer.seed={seed}", *SAME_TRAINING, run_dir=run_dir, timeout=2400)
    final = [r for r in read_metrics(run_dir) if "eval/dpo_accuracy" in r][-1]
    assert final["step"] == 200
    assert final["eval/dpo_accuracy"] >= 0.85


# GRPO from the plain tiny model, with the settings it was tuned for before GRPO's default moved to
# the SFT start: the cheap check that RL climbs the reward at all.
FROM_RANDOM = ["model=tiny", "optim.lr=2e-3", "algo.prompts_per_step=16", "trainer.max_steps=150"]


def test_grpo_learns_at_all_in_30_steps(tiny_cache, tmp_path):
    """The first 30 steps of the run below: the mean reward climbs (3 seeds x 1-2 threads: steps
    21-30 over steps 1-10 by 0.12-0.13)."""
    run_dir = tmp_path / "run"
    rltrain("algo=grpo", *FROM_RANDOM, "trainer.max_steps=30", *SAME_TRAINING, run_dir=run_dir, timeout=600)
    rewards = [r["reward/mean"] for r in train_rows(run_dir)]
    assert len(rewards) == 30
    assert statistics.mean(rewards[-10:]) - statistics.mean(rewards[:10]) >= 0.06


@pytest.mark.slow
def test_grpo_from_the_plain_tiny_model_raises_the_reward(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=grpo", *FROM_RANDOM, *SAME_TRAINING, run_dir=run_dir, timeout=900)
    rewards = [r["reward/mean"] for r in train_rows(run_dir)]
    assert len(rewards) == 150
    assert statistics.mean(rewards[-10:]) - statistics.mean(rewards[:10]) >= 0.2


@pytest.mark.slow  # PPO's claim at full length is slow too (above); its losses, advantages and critic are unit-tested, its runs e2e
def test_ppo_learns_at_all_in_40_steps(tiny_cache, tmp_path):
    """The default PPO command cut to 40 steps: the mean reward climbs (3 seeds x 1-2 threads: steps
    31-40 over steps 1-10 by 0.12-0.15) and the critic learns: its loss falls to 2-3% of where it
    started (asserted: under 25%) and it explains more of the returns (explaining more than their
    mean takes the full run below)."""
    run_dir = tmp_path / "run"
    rltrain("algo=ppo", "trainer.max_steps=40", *SAME_TRAINING, run_dir=run_dir, timeout=600)
    rows = train_rows(run_dir)
    rewards = [r["reward/mean"] for r in rows]
    assert len(rewards) == 40
    assert statistics.mean(rewards[-10:]) - statistics.mean(rewards[:10]) >= 0.06
    value_loss = [r["critic/value_loss"] for r in rows]
    assert statistics.mean(value_loss[-10:]) < 0.25 * statistics.mean(value_loss[:10])
    explained = [r["critic/explained_variance"] for r in rows]
    assert statistics.mean(explained[-10:]) > statistics.mean(explained[:10])


@pytest.mark.slow
def test_ppo_default_raises_the_reward_and_its_critic_explains_it(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=ppo", *SAME_TRAINING, run_dir=run_dir, timeout=900)
    rows = train_rows(run_dir)
    rewards = [r["reward/mean"] for r in rows]
    assert len(rewards) == 150
    assert statistics.mean(rewards[-10:]) - statistics.mean(rewards[:10]) >= 0.2
    assert statistics.mean(r["critic/explained_variance"] for r in rows[-10:]) > 0.0


# The README's story of the embedded default (docs/algorithms.md, "What it does on every seed and
# thread count"), measured over trainer.seed=0,1,2 with 1 and 2 threads on GRPO's fixed 1000
# held-out problems: the SFT start within 0.05 of its mean, each RL gain at least 0.1 and within
# 0.05 of its mean (every run measured was within 0.024 of each).
SFT_START = 0.625
GRPO_GAIN = 0.321
PPO_GAIN = 0.328
PPO_FROM_THE_SFT_START = ["algo=ppo", "model=tiny_sft", "optim.lr=1e-4", "algo.prompts_per_step=64", "algo.group_size=8",
                          "trainer.max_steps=300", "trainer.eval_every=50", "data.num_eval=1000", "data.eval_seed=0"]


def assert_the_documented_story(evals: list[dict], gain: float) -> None:
    start, end = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 300, evals
    assert end - start >= 0.1 and abs(end - start - gain) <= 0.05, evals
    assert abs(start - SFT_START) <= 0.05, evals


def default_grpo_rows(run_dir: Path, seed: int, *extra: str) -> list[dict]:
    """`python -m rltrain trainer.seed=S *extra` run to its end, evaluations on (step 0 is the SFT
    start's accuracy): its metric rows."""
    rltrain(f"trainer.seed={seed}", *extra, "logger.wandb.mode=disabled", "trainer.save_every=0", "trainer.progress=lines",
            run_dir=run_dir, timeout=2400)
    return read_metrics(run_dir)


def heldout_start_and_end(rows: list[dict]) -> tuple[float, float]:
    evals = [r for r in rows if "eval/accuracy" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 300, evals
    return evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]


@pytest.fixture(scope="module")
def synchronous_grpo(tiny_cache, tmp_path_factory) -> Callable[[int], list[dict]]:
    """The synchronous default GRPO run of a seed, run once per module and worker: the tests below
    share it (the same command; they run in one xdist group, so on one worker)."""
    runs: dict[int, list[dict]] = {}

    def rows(seed: int) -> list[dict]:
        if seed not in runs:
            runs[seed] = default_grpo_rows(tmp_path_factory.mktemp(f"sync_grpo_seed{seed}"), seed)
        return runs[seed]

    return rows


# The tests that read `synchronous_grpo` run on one worker, so each seed's synchronous run is made once.
SHARES_THE_SYNCHRONOUS_RUN = pytest.mark.xdist_group("synchronous_grpo")


@pytest.mark.slow
@SHARES_THE_SYNCHRONOUS_RUN
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_default_raises_heldout_accuracy(synchronous_grpo, seed):
    """`python -m rltrain trainer.seed=S`: from the SFT start (model=tiny_sft, built here once per
    seed and test cache), GRPO raises held-out exact-match accuracy as the README says. Evaluations
    stay on (step 0 is the SFT start's accuracy)."""
    assert_the_documented_story([r for r in synchronous_grpo(seed) if "eval/accuracy" in r], GRPO_GAIN)


@pytest.mark.slow
@SHARES_THE_SYNCHRONOUS_RUN
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_async_grpo_default_learns_as_the_synchronous_one(synchronous_grpo, tmp_path, seed):
    """docs/async.md, "Measured": the default generating one step ahead (vLLM in its own process)
    raises held-out accuracy by at least 0.1 from the same SFT start and ends within 0.03 of the
    synchronous run (within 0.005 on all three seeds here)."""
    sync = heldout_start_and_end(synchronous_grpo(seed))
    ahead = heldout_start_and_end(default_grpo_rows(tmp_path / "async", seed, "rollout.process=separate", "placement.max_staleness=1"))
    assert sync[0] == ahead[0], (sync, ahead)  # the same start
    assert ahead[1] - ahead[0] >= 0.1, (sync, ahead)
    assert abs(ahead[1] - sync[1]) <= 0.03, (sync, ahead)


# docs/async.md, "Weights in flight": k = 1, each version loaded between two decoding steps, each
# batch the first groups to complete; as a user runs it (timing-dependent, not placement.deterministic).
IN_FLIGHT_STREAMING = ["rollout.process=separate", "placement.max_staleness=1", "placement.weight_update=in_flight",
                       "placement.stream=true"]


@pytest.mark.slow
@SHARES_THE_SYNCHRONOUS_RUN
@pytest.mark.parametrize("seed", [0, 1])
def test_inflight_streaming_grpo_default_learns_as_the_synchronous_one(synchronous_grpo, tmp_path, seed):
    """Issue 64 point 5 (docs/async.md, "Learning in flight with streaming"): the default with
    weights in flight and streaming ends within 0.02 of the synchronous run's held-out accuracy,
    from the same start, every token trained within the bound of one version. The mode is
    timing-dependent: measured, 7 of 8 runs within 0.02 (seed 0's five ends spread over 0.033)."""
    sync = heldout_start_and_end(synchronous_grpo(seed))
    rows = default_grpo_rows(tmp_path / "inflight", seed, *IN_FLIGHT_STREAMING)
    streamed = heldout_start_and_end(rows)
    assert sync[0] == streamed[0], (sync, streamed)  # the same start
    assert abs(streamed[1] - sync[1]) <= 0.02, (sync, streamed)
    trained = [r for r in rows if "loss" in r]
    assert len(trained) == 300 and all(r["rollout/staleness_max"] <= 1 for r in trained)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ppo_from_the_sft_start_raises_heldout_accuracy(tiny_cache, tmp_path, seed):
    """The README's documented PPO command from the SFT start raises held-out exact-match accuracy
    as documented (step 0 is the SFT start's accuracy)."""
    run_dir = tmp_path / "run"
    rltrain(*PPO_FROM_THE_SFT_START, f"trainer.seed={seed}", "logger.wandb.mode=disabled", "trainer.save_every=0",
            "trainer.progress=lines", run_dir=run_dir, timeout=2400)
    assert_the_documented_story([r for r in read_metrics(run_dir) if "eval/accuracy" in r], PPO_GAIN)


# conf/experiment/rm_then_ppo.yaml's first command (its run dir given here by run_dir).
RM_FOR_PPO = ["algo=rm", "model=tiny_sft", "data.num_eval=1000", "data.eval_seed=0", "data.same_length_rejected=0.8",
              "optim.lr=3e-4", "trainer.max_steps=600"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_scored_by_a_trained_reward_model_raises_heldout_accuracy(tiny_cache, tmp_path, seed):
    """`+experiment=rm_then_ppo`'s two commands: a reward model trained on the task's pairs, then PPO
    from the SFT start scored by it alone (the task's reward weighted 0) raises held-out exact-match
    accuracy by at least 0.1 (measured +0.122 and +0.113 on seeds 0 and 1; docs/algorithms.md, "Reward model then PPO")."""
    rm_dir, run_dir = tmp_path / "rm", tmp_path / "run"
    rltrain(*RM_FOR_PPO, f"trainer.seed={seed}", *SAME_TRAINING, run_dir=rm_dir, timeout=2400)
    rltrain("+experiment=rm_then_ppo", f"reward_model.path={rm_dir / 'final'}", f"trainer.seed={seed}",
            "logger.wandb.mode=disabled", "trainer.save_every=0", "trainer.progress=lines", run_dir=run_dir, timeout=2400)
    rows = read_metrics(run_dir)
    scored = [r for r in rows if "reward/mean" in r]
    # the checkable reward: weight 0 (the mean of the weighted sum, rounded apart only in the last bits)
    assert scored and all(r["reward/model"] == pytest.approx(r["reward/mean"], abs=1e-9) for r in scored)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 100, evals
    assert evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"] >= 0.1, evals


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_scored_by_a_trained_judge_alone_raises_heldout_accuracy(tiny_cache, tmp_path, seed):
    """`+experiment=judge_then_grpo`'s two commands: a tiny judge trained on the task's verdicts (its
    held-out verdict accuracy at least 0.95), then GRPO from the SFT start scored by that judge alone
    (served by vLLM in the run; the task's reward weighted 0) raises held-out exact-match accuracy by
    at least 0.1 (docs/rewards-and-roles.md, "A tiny judge, then GRPO scored by it alone")."""
    judge_dir, run_dir = tmp_path / "judge", tmp_path / "run"
    evaluated = [a for a in SAME_TRAINING if not a.startswith("trainer.eval_every=")]  # the judge's own evaluations
    made = python("-m", "rltrain.rewards.judge.tiny_judge", f"trainer.seed={seed}", *evaluated,
                  f"hydra.run.dir={judge_dir}", timeout=3600, warm=False)
    assert made.returncode == 0, made.stderr[-3000:]
    verdicts = [r for r in read_metrics(judge_dir) if "eval/accuracy" in r]
    assert verdicts[-1]["step"] == 3500 and verdicts[-1]["eval/accuracy"] >= 0.95, verdicts
    rltrain("+experiment=judge_then_grpo", f"reward_model.path={judge_dir / 'final'}", f"trainer.seed={seed}",
            "logger.wandb.mode=disabled", "trainer.progress=lines", run_dir=run_dir, timeout=3600)
    rows = read_metrics(run_dir)
    scored = [r for r in rows if "reward/mean" in r]
    # the checkable reward: weight 0 (the mean of the weighted sum, rounded apart only in the last bits)
    assert scored and all(r["reward/judge"] == pytest.approx(r["reward/mean"], abs=1e-9) for r in scored)
    assert sum(r["reward/judge_timeouts"] + r["reward/judge_errors"] for r in scored) == 0
    evals = [r for r in rows if "eval/accuracy" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 100, evals
    assert evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"] >= 0.1, evals


# LoRA (docs/lora.md, "Does it learn?"): the documented commands, adapters of rank 32 on every
# linear layer of the decoder.
LORA = ["model.lora.rank=32", "model.lora.alpha=64"]


@pytest.mark.slow
def test_lora_dpo_reaches_heldout_preference_accuracy(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=dpo", *LORA, "optim.lr=2e-3", "trainer.max_steps=300", *SAME_TRAINING, run_dir=run_dir, timeout=1500)
    final = [r for r in read_metrics(run_dir) if "eval/dpo_accuracy" in r][-1]
    assert final["step"] == 300 and final["eval/dpo_accuracy"] >= 0.9


@pytest.mark.slow
def test_lora_grpo_from_the_sft_start_raises_heldout_accuracy(tiny_cache, tmp_path):
    """The default GRPO command with rank-32 adapters and a 10x learning rate: held-out exact-match
    accuracy rises (seen +0.344 where full fine-tuning gained +0.342 from the same SFT start, one seed,
    docs/lora.md)."""
    run_dir = tmp_path / "run"
    rltrain(*LORA, "optim.lr=1e-3", "logger.wandb.mode=disabled", "trainer.save_every=0", "trainer.progress=lines",
            run_dir=run_dir, timeout=2400)
    evals = [r for r in read_metrics(run_dir) if "eval/accuracy" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 300
    assert evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"] >= 0.15, evals


# The built-in tool task (docs/environments.md, "The built-in tool task"): `+experiment=grpo_calculator`
# over trainer.seed=0,1,2 with 1 and 2 threads. The start calls the tool on a share of the held-out
# prompts (its greedy success CALCULATOR_START, +-0.05 here); RL makes it call on nearly every one.
CALCULATOR_START = (0.12, 0.175)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_calculator_learns_to_call_its_tool(tiny_cache, tmp_path, seed):
    run_dir = tmp_path / "run"
    rltrain("+experiment=grpo_calculator", f"trainer.seed={seed}", "logger.wandb.mode=disabled", "trainer.save_every=0",
            "trainer.progress=lines", run_dir=run_dir, timeout=2400)
    rows = read_metrics(run_dir)
    evals = [r for r in rows if "eval/success" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 40, evals
    start, end = evals[0]["eval/success"], evals[-1]["eval/success"]
    assert CALCULATOR_START[0] - 0.05 <= start <= CALCULATOR_START[1] + 0.05, evals
    assert end >= 0.95 and end - start >= 0.1, evals
    last = [r for r in rows if "env/turns_mean" in r][-1]
    assert last["env/turns_mean"] >= 2.0 and last["env/tool_calls_mean"] >= 1.0, last


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_reasoning_gym_raises_heldout_accuracy(tiny_cache, tmp_path, seed):
    """`+experiment=grpo_reasoning_gym` (docs/environments.md, "reasoning-gym"): greedy held-out accuracy
    on reasoning-gym's spell_backward (full marks from its own score_answer) rises by at least 0.15
    over its SFT start's (step 0) by the last step, and the run, SFT start included, takes under 15
    minutes with one thread (measured: 0.22 -> 0.805 and 0.745 -> 0.93 on seeds 0 and 1, 8 and 7.2 minutes)."""
    run_dir = tmp_path / "run"
    started = time.monotonic()
    rltrain("+experiment=grpo_reasoning_gym", f"trainer.seed={seed}", "trainer.num_threads=1", "logger.wandb.mode=disabled",
            "trainer.save_every=0", "trainer.progress=lines", run_dir=run_dir, timeout=3600)
    elapsed = time.monotonic() - started
    rows = read_metrics(run_dir)
    evals = [r for r in rows if "eval/accuracy/spell_backward" in r]
    assert [r["step"] for r in evals] == [0, 25, 50, 75, 100, 125, 150], evals
    assert evals[-1]["eval/accuracy/spell_backward"] - evals[0]["eval/accuracy/spell_backward"] >= 0.15, evals
    assert elapsed < 15 * 60, elapsed
    assert all(r["reward/timeouts"] == r["reward/errors"] == 0.0 for r in rows if "reward/timeouts" in r)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_code_raises_the_heldout_pass_rate(tiny_cache, tmp_path, seed):
    """`+experiment=grpo_code` (docs/rewards-and-roles.md, "The built-in code task"): the held-out
    pass rate (`eval/reward`: greedy, the fraction of hidden asserts passed in the sandbox) rises by
    at least 0.15 over its SFT start's (step 0) by step 30, as measured with one thread per rank
    (measured: 0.46 -> 1.0 and 0.455 -> 0.995 on seeds 0 and 1, seed 1 flat until step 10)."""
    run_dir = tmp_path / "run"
    rltrain("+experiment=grpo_code", f"trainer.seed={seed}", "trainer.num_threads=1", "logger.wandb.mode=disabled",
            "trainer.save_every=0", "trainer.progress=lines", run_dir=run_dir, timeout=3600)
    rows = read_metrics(run_dir)
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 10, 20, 30], evals
    assert evals[-1]["eval/reward"] - evals[0]["eval/reward"] >= 0.15, evals
    assert all(r["reward/timeouts"] == r["reward/errors"] == 0.0 for r in rows if "reward/timeouts" in r)  # the reward calls never failed


@pytest.mark.slow
def test_agent_calculator_learns_as_grpo_calculator_does(tiny_cache, tmp_path):
    """The same task, start and settings as above, the episodes played by an OpenAI-client agent
    behind the run's endpoint (env=agent): it reaches what grpo_calculator reaches (docs/agents.md)."""
    run_dir = tmp_path / "run"
    rltrain("+experiment=agent_calculator", "trainer.seed=0", "logger.wandb.mode=disabled", "trainer.save_every=0",
            "trainer.progress=lines", run_dir=run_dir, timeout=3600)
    rows = read_metrics(run_dir)
    evals = [r for r in rows if "eval/success" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 40, evals
    start, end = evals[0]["eval/success"], evals[-1]["eval/success"]
    assert CALCULATOR_START[0] - 0.05 <= start <= CALCULATOR_START[1] + 0.05, evals
    assert end >= 0.95 and end - start >= 0.1, evals
    last = [r for r in rows if "env/turns_mean" in r][-1]
    assert last["env/turns_mean"] >= 2.0 and last["env/tool_calls_mean"] >= 1.0, last
