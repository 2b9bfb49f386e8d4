"""`env=agent` end to end (docs/agents.md): the examples/ agents, which the package never imports,
trained unchanged behind the run's endpoint on the tiny model. The plain `openai` client agent on two
ranks with the HF engine (its calls merge into one sequence per episode: train/rollout parity in fp32
over them, named rewards logged), an agent that rewrites its history (GRPO and PPO train every
sequence), the OpenAI Agents SDK agent, the plain agent on vLLM in-process and in its own process;
what env=agent cannot run is refused by name."""

from __future__ import annotations

import pytest
from cli import ROOT, SMALL_MODEL, read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

EXAMPLES = {"PYTHONPATH": str(ROOT / "examples")}
# The tiny tokenizer's chat template with each assistant turn ended by the engine's stop token (as
# Qwen's <|im_end|>): an agent that appends to its history renders what was sampled, token for token.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>{% endif %}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)
AGENT_RUN = [
    "algo=grpo", "model=tiny", *SMALL_MODEL, "rollout=hf", "env=agent", "env.agent=openai_agent:run", "env.workers=2",
    "algo.prompts_per_step=4", "algo.group_size=2", "data.num_eval=4", "trainer.max_steps=2", "trainer.log_every=1",
    "trainer.eval_every=2", "trainer.save_every=0", "trainer.progress=lines", "logger.wandb.mode=disabled",
]


@pytest.fixture
def template_file(tmp_path):
    path = tmp_path / "turns.jinja"
    path.write_text(TEMPLATE)
    return path


def test_a_plain_openai_client_agent_trains_on_two_ranks_on_every_token_it_was_served(template_file, tmp_path):
    rltrain(*AGENT_RUN, "trainer.nproc=2", f"env.chat_template={template_file}", run_dir=tmp_path / "run", timeout=500, env=EXAMPLES)
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # The random model rarely answers right: most episodes ask twice (the example's second try).
        assert 1.0 < r["env/turns_mean"] <= 4.0, r
        assert r["env/timeouts"] == r["env/errors"] == r["env/no_calls"] == 0.0, r
        # The second call extends the first: merged into one sequence, unless the random model
        # sampled a special token its reply's text leaves out (then the rendering differs: a
        # rewrite; how often depends on the batching). The merge itself is proven token for token in
        # tests/unit/envs/test_agent.py; here: a rewrite is only ever a follow-up call.
        assert r["env/history_rewrites"] <= (r["env/turns_mean"] - 1.0) * 8, r
        assert r["rollout/logprob_diff_max"] < 1e-3, r  # every sampled token of every call, in fp32
        assert {"reward/correct", "reward/brief"} <= set(r)
        assert r["reward/mean"] == pytest.approx(r["reward/env"]) == pytest.approx(r["reward/correct"] + r["reward/brief"])
    evals = [r for r in read_metrics(tmp_path / "run") if "eval/reward" in r]
    assert evals and all(0.0 <= r["eval/success"] <= 1.0 for r in evals)


REWRITER = """
def run(client, row):
    \"\"\"Asks, then asks again with its history summarised: two sequences per episode; a third of the
    rows ask for two replies at once (a fork).\"\"\"
    n = 2 if row["answer"].endswith("3") else 1
    first = client.chat.completions.create(model="x", messages=[{"role": "user", "content": row["prompt"]}], n=n)
    summary = "earlier: " + (first.choices[0].message.content or "")[:3]
    again = client.chat.completions.create(model="x", messages=[{"role": "user", "content": summary + " " + row["prompt"]}])
    return float((again.choices[0].message.content or "").strip() == row["answer"])
"""


# PPO (the critic on every sequence) is `slow`: the sequences are GRPO's, and tests/dist/algos/test_agent_sequences.py holds their training.
@pytest.mark.parametrize("algo", ["grpo", pytest.param("ppo", marks=pytest.mark.slow)])
def test_an_agent_that_rewrites_its_history_trains_every_sequence_on_two_ranks(tmp_path, algo):
    """Each episode trains two or three sequences with its advantage (PPO: its reward, its critic's
    values); the ranks hold different numbers of sequences and agree on their micro-batches (a
    mismatch would hang the collective)."""
    (tmp_path / "rewriter.py").write_text(REWRITER)
    rltrain(*AGENT_RUN, f"algo={algo}", "env.agent=rewriter:run", "trainer.nproc=2", "trainer.micro_batch_size=4", "trainer.eval_every=0",
            run_dir=tmp_path / "run", timeout=500, env={"PYTHONPATH": str(tmp_path)})
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["env/turns_mean"] == 2.0 and r["env/history_rewrites"] == 8.0, r  # every episode's second call
        assert r["rollout/logprob_diff_max"] < 1e-3, r  # over every sequence's sampled tokens


def test_an_openai_agents_sdk_agent_trains_unchanged(tmp_path):
    rltrain(*AGENT_RUN, "env.agent=agents_sdk_agent:run", "trainer.max_steps=1", "trainer.eval_every=0",
            run_dir=tmp_path / "run", timeout=400, env=EXAMPLES)
    (r,) = train_rows(tmp_path / "run")
    assert r["env/turns_mean"] >= 1.0 and r["env/errors"] == r["env/timeouts"] == r["env/no_calls"] == 0.0, r
    assert r["rollout/logprob_diff_max"] < 1e-3, r


@pytest.mark.parametrize("process", ["colocated", "separate"])
def test_the_endpoint_serves_from_vllm_in_process_or_in_its_own(template_file, tmp_path, process):
    rltrain(*AGENT_RUN, "rollout=vllm", f"rollout.process={process}", "trainer.max_steps=1", "trainer.eval_every=0", f"env.chat_template={template_file}",
            run_dir=tmp_path / "run", timeout=500, env=EXAMPLES)
    (r,) = train_rows(tmp_path / "run")
    assert r["env/turns_mean"] > 1.0 and r["env/errors"] == 0.0, r
    assert r["rollout/logprob_diff_max"] < 1e-2, r  # vLLM's kernels against the trainer's


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["env.agent=null"], "env=agent needs env.agent=package.module:function"),
        (["reward.fns=[rltrain.rewards.builtin:exact_match]"], "env=agent takes its rewards from what the agent returns"),
        (["env=python", "env.cls=higher_lower:HigherLower"], "env.agent is set but env=python does not use it"),
        (["env.chat_template=/no/such/template.jinja"], "env.chat_template='/no/such/template.jinja' is neither"),
        (["env.agent=openai_agnt:run"], "env.agent 'openai_agnt:run' could not be loaded (ModuleNotFoundError"),
        (["env.agent=json:dumps"], "env.agent 'json:dumps' must take two arguments, (client, row)"),
    ],
)
def test_what_env_agent_cannot_run_is_refused_by_name(tiny_cache, tmp_path, override, message):
    """Refused in the launcher, before any rank, model or engine starts (a typo costs seconds)."""
    proc = rltrain(*AGENT_RUN, *override, run_dir=tmp_path / "run", check=False, timeout=200, env=EXAMPLES)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
