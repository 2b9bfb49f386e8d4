"""`env=python` and `env=tools` end to end (docs/environments.md), every run on two ranks: GRPO
(vLLM, FSDP) and PPO (HF engine, Megatron tp=2 with time sharing: the replica's leader plays) play
multi-turn episodes of a user environment (examples/higher_lower.py, which the package never
imports); GRPO with time sharing calls user tools (examples/calculator.py plus one that hangs). The model's tokens keep their engine log-probabilities
through the turns (train/rollout parity in fp32), the episode metrics are logged, held-out episodes
are evaluated, a hung tool costs its call and not the run, and a run killed mid-way resumes to the
uninterrupted result. A configuration this release cannot run multi-turn is refused by name."""

from __future__ import annotations

import json
import shutil
import signal

import pytest
from cli import QUICK, ROOT, SMALL_MODEL, comparable, kill_when, read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

EXAMPLES = {"PYTHONPATH": str(ROOT / "examples")}
ENV_RUN = [
    "algo=grpo", "model=tiny", *SMALL_MODEL, "env=python", "env.cls=higher_lower:HigherLower",
    "env.max_turns=3", "algo.prompts_per_step=4", "algo.group_size=2", "data.num_eval=4", "trainer.max_steps=2",
    "trainer.log_every=1", "trainer.eval_every=2", "trainer.save_every=1", "trainer.progress=lines",
    "trainer.nproc=2", "logger.wandb.mode=disabled",
]


@pytest.fixture
def env_run(shared_runs):
    """The uninterrupted run, shared: once per session whichever worker asks first."""
    return shared_runs.get(*ENV_RUN, timeout=400, env=EXAMPLES)


def test_grpo_trains_on_multi_turn_episodes_on_two_ranks(env_run):
    rows = train_rows(env_run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # The random tiny model rarely answers right: most episodes take every turn.
        assert 1.0 < r["env/turns_mean"] <= 3.0, r
        assert r["env/timeouts"] == r["env/errors"] == 0.0
        assert r["rollout/logprob_diff_max"] < 1e-3, r  # every sampled token, whatever turn it came from
        assert "reward/env" in r and r["reward/mean"] == pytest.approx(r["reward/env"])
    evals = [r for r in read_metrics(env_run) if "eval/reward" in r]
    assert evals and all("eval/accuracy" not in r and 0.0 <= r["eval/success"] <= 1.0 for r in evals)


# slow: an episode batch's checkpoint round trip is tests/unit/envs/test_agent.py's, a killed run's resume
# test_cli_sft.py's and test_cli_async.py's, all in make test.
@pytest.mark.slow
def test_a_multi_turn_run_killed_after_its_first_step_resumes_to_the_uninterrupted_result(env_run, tmp_path):
    """The environments live for one step: the resumed run starts step 2 with new ones, and every
    row (rewards, turns, losses) equals the uninterrupted run's."""
    run_dir = tmp_path / "killed"
    kill_when(ENV_RUN, run_dir, run_dir / "checkpoints" / "step_00000001", signal.SIGKILL, timeout=400, env=EXAMPLES)
    assert len(train_rows(run_dir)) < 2
    rltrain(*ENV_RUN, run_dir=run_dir, timeout=400, env=EXAMPLES)
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed if "loss" in r] == [1, 2]
    assert comparable(resumed) == comparable(read_metrics(env_run))


def test_ppo_plays_multi_turn_episodes_on_the_replica_leader_under_megatron_tensor_parallelism(tiny_cache, tmp_path):
    """PPO's critic and GAE over the sampled tokens only (tests/unit/algos/test_ppo_math.py has the
    values), the HF engine taking the turns, Megatron training with tp=2 and time sharing: the
    replica's leader plays the episodes and shares them (rltrain/envs/replica.py); the engine's
    micro-batch fingerprint fails the step if the two ranks were given different sequences."""
    rltrain(*ENV_RUN, "algo=ppo", "rollout=hf", "backend=megatron", "backend.tp=2", "model.num_kv_heads=2",
            "placement.time_sharing=true", "trainer.eval_every=0", "trainer.save_every=0",
            run_dir=tmp_path / "run", timeout=400, env=EXAMPLES)
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 1.0 < r["env/turns_mean"] <= 3.0, r
        assert r["rollout/logprob_diff_max"] < 1e-3, r
        assert {"critic/value_loss", "critic/explained_variance", "adv/mean", "env/success"} <= set(r)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["reward.fns=[rltrain.rewards.builtin:exact_match]"], "reward.fns and reward_model are not called"),
        (["env.cls=no_colon"], "env=python needs env.cls=package.module:Class"),
        (["env.max_turns=0"], "env.max_turns=0 must be at least 1"),
        (["env.tools=[calculator:add]"], "env.tools=['calculator:add'] is set but env=python does not use it"),
    ],
)
def test_what_env_python_cannot_run_is_refused_by_name(tiny_cache, tmp_path, override, message):
    proc = rltrain(*ENV_RUN, *override, run_dir=tmp_path / "run", check=False, timeout=120, env=EXAMPLES)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr


HANG_TOOL = """
import time

def hang(seconds: int) -> str:
    \"\"\"Sleeps far longer than any timeout.

    Args:
        seconds: ignored
    \"\"\"
    time.sleep(100000)
    return "late"
"""
ADD_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
HANG_CALL = '<tool_call>{"name": "hang", "arguments": {"seconds": 1}}</tool_call>'


@pytest.fixture(scope="module")
def tool_caller(tiny_cache, tmp_path_factory):
    """A small model taught (a short SFT) to call `add` after prompts "a.|" and `hang` after "h.|". 80 steps
    keep the margin (docs/testing.md, "What learns in `make test`"); 60 left a malformed call, 40 teach none."""
    root = tmp_path_factory.mktemp("tool_caller")
    rows = [{"prompt": f"{'ah'[i % 2]}{i % 10}|", "completion": ADD_CALL if i % 2 == 0 else HANG_CALL} for i in range(64)]
    (root / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    rltrain("algo=sft", *QUICK, *SMALL_MODEL, f"data.path={root / 'sft.jsonl'}", "trainer.max_steps=80", "optim.lr=3e-3",
            run_dir=root / "sft", timeout=300)
    (root / "hanging_tools.py").write_text(HANG_TOOL)
    prompts = [{"prompt": f"{'ah'[i % 2]}{i % 10}|", "answer": "5"} for i in range(40)]
    (root / "rl.jsonl").write_text("\n".join(json.dumps(r) for r in prompts))
    return root


def test_tools_are_called_in_workers_and_a_hung_tool_is_counted_while_the_run_goes_on(tool_caller, tmp_path):
    root = tool_caller
    rltrain(
        "algo=grpo", f"model.path={root / 'sft' / 'final'}", f"data.path={root / 'rl.jsonl'}", "data.eval_fraction=0.1",
        "env=tools", "env.tools=[calculator:add,hanging_tools:hang]", "env.describe_tools=false", "env.max_turns=2",
        "env.max_tokens_per_turn=96", "algo.temperature=0.5",
        "env.timeout_s=1",
        "reward.fns=[rltrain.rewards.builtin:exact_match]", "algo.prompts_per_step=4", "algo.group_size=2",
        "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=2", "trainer.save_every=0",
        "trainer.progress=lines", "trainer.nproc=2", "logger.wandb.mode=disabled", "placement.time_sharing=true",
        run_dir=tmp_path / "run", timeout=400, env={"PYTHONPATH": f"{ROOT / 'examples'}:{root}"},
    )
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # The model calls a tool at its first turn (half the prompts `add`, half `hang`) and answers
        # after reading the result (here, an error for `hang`: killed after 1 s).
        assert r["env/tool_calls_mean"] >= 0.5 and r["env/turns_mean"] > 1.0, r
        assert r["env/errors"] == 0.0, r
        assert r["rollout/logprob_diff_max"] < 1e-3, r  # over the sampled tokens of every turn
        assert {"reward/exact_match", "env/success"} <= set(r)
    assert sum(r["env/timeouts"] for r in rows) >= 1.0  # the hung calls, counted; the run went on
    evals = [r for r in read_metrics(tmp_path / "run") if "eval/accuracy" in r]
    assert evals and {"eval/reward", "eval/success"} <= set(evals[0])


# A chat template with a Qwen3-like rule for earlier turns: an assistant turn followed by more
# messages is rendered without its thinking block. The random tiny model never writes `</think>`,
# so this block ends at `~`, which it writes in about one reply in six.
DROPS_THINKING = (
    "{% for m in messages %}{{ m['role'][0] | upper }}:{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ m['content'].split('~')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
    "{% if m['role'] == 'assistant' %}<eos>{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)
AGAIN = """
class Again:
    \"\"\"Three replies, each but the last answered by a user message; reward: their length.\"\"\"
    def reset(self, **row):
        self.turns = 0

    def step(self, text):
        self.turns += 1
        done = self.turns >= 3
        return (None if done else [{"role": "user", "content": "again"}]), len(text) / 10, done
"""


def test_a_template_that_drops_earlier_thinking_is_followed_and_every_trained_token_was_sampled_where_trained(tiny_cache, tmp_path):
    """Each reply the template rewrites is replaced in the next turn's prompt by the template's
    rendering and trains as its own sequence: train/rollout parity over every sequence proves each
    trained token is scored on exactly the ids it was sampled after (tests/unit/envs/test_episodes.py
    has the sequences token for token)."""
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    small = {k.split(".")[1]: int(v) for k, v in (a.split("=") for a in SMALL_MODEL)}
    model = tmp_path / "model"
    shutil.copytree(build_tiny_model_dir(ModelConfig(**small), seed=0), model)
    (model / "chat_template.jinja").write_text(DROPS_THINKING)
    (tmp_path / "again_env.py").write_text(AGAIN)
    rows = [{"prompt": [{"role": "user", "content": f"{i}?"}]} for i in range(40)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rltrain(
        "algo=grpo", *QUICK, f"model.path={model}", "rollout=hf", f"data.path={tmp_path / 'chat.jsonl'}", "data.eval_fraction=0",
        "env=python", "env.cls=again_env:Again", "env.max_turns=3", "env.max_tokens_per_turn=12", "algo.prompts_per_step=8",
        "algo.group_size=4", "trainer.max_steps=2", "trainer.log_every=1", run_dir=tmp_path / "run", timeout=400,
        env={"PYTHONPATH": str(tmp_path)},
    )
    steps = train_rows(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["env/turns_mean"] == 3.0 and r["env/errors"] == 0.0, r
        assert r["rollout/logprob_diff_max"] < 1e-3, r  # the episodes' sequences and the rewritten replies' own
    assert sum(r["env/history_rewrites"] for r in steps) > 0  # some replies wrote `~`: their thinking was dropped
