"""The recipes (`+experiment=NAME`, conf/experiment/) and the first real run they stand for: every
recipe composes, and runs a few steps on CPU with its model and dataset replaced by stand-ins of
the same format, laid into the test run's Hugging Face caches under the recipe's own Hub ids and
read offline (the tiny model with its chat template as the recipes' Qwen2.5-0.5B-Instruct).

The GRPO recipe's run is also the end-to-end test of Hub ids (model and dataset), `data.columns`,
`data.map_fn` and the math reward."""

from __future__ import annotations

import math

import pytest
from cli import ROOT, SMALL_MODEL, python, read_metrics, rltrain
from helpers import compose_config
from hub_cache import lay_dataset, lay_model

pytestmark = pytest.mark.e2e

RECIPES = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
# What a CPU run of a few steps changes; the recipes' own models, data, columns, maps, rewards,
# algorithms and engines are kept.
CPU = ["trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=lines", "logger.wandb.mode=disabled",
       "model.gradient_checkpointing=false", "data.max_length=160"]
STAND_IN_RUNS = {
    "grpo_gsm8k": [*CPU, "trainer.max_steps=3", "algo.prompts_per_step=2", "algo.group_size=2",
                   "algo.max_new_tokens=8", "trainer.micro_batch_size=4", "trainer.log_every=1"],
    "dpo_ultrafeedback": [*CPU, "trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
                          "trainer.log_every=1"],
    "simpo_ultrafeedback": [*CPU, "trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
                            "trainer.log_every=1"],
    "kto_unpaired": [*CPU, "trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
                     "trainer.log_every=1"],
    # Step 2 of two commands: a reward model trained by step 1 (algo=rm, the small tiny model, in the
    # test) scores PPO from a short SFT start of the small tiny model.
    "rm_then_ppo": [*CPU, "trainer.max_steps=2", "algo.prompts_per_step=2", "algo.group_size=2", "data.num_eval=4",
                    "model.sft_steps=10", *SMALL_MODEL, "trainer.log_every=1"],
    # Step 2 of two commands: a judge trained by step 1 (python -m rltrain.rewards.judge.tiny_judge, the
    # small tiny model, in the test) served by a vLLM API server of the run, scores GRPO from a short SFT start.
    "judge_then_grpo": [*CPU, "trainer.max_steps=2", "algo.prompts_per_step=2", "algo.group_size=2", "data.num_eval=4",
                        "model.sft_steps=10", *SMALL_MODEL, "trainer.log_every=1"],
    "sft_chat": [*CPU, "trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
                 "trainer.log_every=1"],
    # The built-in task: a short SFT start of the small tiny model stands in for the recipe's.
    "dr_grpo": [*CPU, "trainer.max_steps=2", "algo.prompts_per_step=2", "algo.group_size=2", "data.num_eval=4",
                "model.sft_steps=10", *SMALL_MODEL, "trainer.log_every=1"],
    "gspo": [*CPU, "trainer.max_steps=2", "algo.prompts_per_step=2", "algo.group_size=2", "data.num_eval=4",
             "model.sft_steps=10", *SMALL_MODEL, "trainer.log_every=1"],
    # The built-in tool task: a short SFT start of the small tiny model stands in for the recipe's.
    "grpo_calculator": [*CPU, "trainer.max_steps=2", "algo.prompts_per_step=2", "algo.group_size=2", "data.num_eval=4",
                        "model.sft_steps=10", *SMALL_MODEL, "trainer.log_every=1"],
    # The built-in visual task: a 10-step SFT start of the tiny vision-language model stands in for the recipe's.
    "grpo_vision": [*CPU, "trainer.max_steps=2", "algo.prompts_per_step=2", "algo.group_size=2", "data.num_eval=4",
                    "model.sft_steps=10", "trainer.log_every=1"],
    # The built-in code task: a short SFT start of the small tiny model, scored in the bubblewrap sandbox.
    "grpo_code": [*CPU, "trainer.max_steps=2", "algo.prompts_per_step=2", "algo.group_size=2", "data.num_eval=4",
                  "model.sft_steps=10", *SMALL_MODEL, "trainer.log_every=1"],
    # reasoning-gym's spell_backward: a short SFT start of the small tiny model stands in for the recipe's.
    "grpo_reasoning_gym": [*CPU, "trainer.max_steps=2", "algo.prompts_per_step=2", "algo.group_size=2", "data.num_eval=4",
                           "model.sft_steps=10", *SMALL_MODEL, "trainer.log_every=1"],
    "agent_calculator": [*CPU, "trainer.max_steps=2", "algo.prompts_per_step=2", "algo.group_size=2", "data.num_eval=4",
                         "model.sft_steps=10", *SMALL_MODEL, "trainer.log_every=1"],
    # The tiny MoE with router replay: a 10-step SFT start of the tiny MoE stands in for the recipe's.
    "grpo_moe": [*CPU, "trainer.max_steps=2", "algo.prompts_per_step=2", "algo.group_size=2", "data.num_eval=4",
                 "model.sft_steps=10", "trainer.log_every=1"],
}
# Recipes whose run adds no mechanism to `make test` (it is run elsewhere at its cheapest level): their
# stand-in runs are `slow`; every recipe still composes and passes the run's checks in `make test`.
RUN_ELSEWHERE = {
    "agent_calculator": "tests/e2e/test_cli_agent.py", "dr_grpo": "tests/unit/algos (the objective)",
    "grpo_calculator": "tests/e2e/test_cli_env.py", "grpo_code": "tests/e2e/test_cli_code_reward.py",
    "grpo_moe": "tests/e2e/test_cli_moe.py (GRPO with router replay)", "grpo_reasoning_gym": "tests/e2e/test_cli_ecosystems.py",
    "grpo_vision": "tests/e2e/test_cli_vision_rl.py", "gspo": "tests/unit/algos (the objective)",
    "judge_then_grpo": "tests/unit/rewards/test_judge.py and test_tiny_judge.py (the judge's calls, its training rows); "
                       "tests/e2e/test_cli_server.py (a server the run spawns)",
    "kto_unpaired": "tests/e2e/test_cli_kto.py", "simpo_ultrafeedback": "dpo_ultrafeedback's run (the same data)",
}
# Recipes named by the objective their algorithm runs (`+experiment=gspo` is algo=grpo with GSPO's loss).
OBJECTIVE_OF = {"gspo": "grpo"}
# Recipes of a first real run: a Hub model and a Hub dataset (the others run on the built-in tiny model and task).
HUB_RECIPES = ["dpo_ultrafeedback", "grpo_gsm8k", "kto_unpaired", "simpo_ultrafeedback", "sft_chat"]


def chat(*turns: str) -> list[dict]:
    return [{"role": role, "content": text} for role, text in zip(["user", "assistant"] * len(turns), turns)]


# Rows in each recipe's dataset format (GSM8K's question/answer; TRL's preference and chat sets).
STAND_IN_ROWS = {
    "openai/gsm8k": [{"question": f"Tom has {a} apples and buys {a}. How many?", "answer": f"{a}+{a}={2 * a}\n#### {2 * a}"}
                     for a in range(1, 41)],
    "trl-lib/ultrafeedback_binarized": [
        {"chosen": chat(f"{a}+1?", str(a + 1)), "rejected": chat(f"{a}+1?", str(a + 2)), "score_chosen": 8.0,
         "score_rejected": 2.0} for a in range(40)
    ],
    "trl-lib/kto-mix-14k": [
        {"prompt": chat(f"{a}+1?"), "completion": [{"role": "assistant", "content": str(a + 1 + 2 * (a % 2))}],
         "label": a % 2 == 0} for a in range(40)
    ],
    "trl-lib/Capybara": [{"messages": chat(f"{a}+1?", str(a + 1), "and +2?", str(a + 2)), "source": "x"} for a in range(40)],
}


@pytest.fixture(scope="session")
def stand_ins(tiny_cache):
    """Each recipe's model id and dataset id laid into the HF caches (conftest.py), once per worker."""
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    laid, datasets = {}, set()
    model_dir = build_tiny_model_dir(ModelConfig(), seed=0)
    for name in HUB_RECIPES:
        cfg = compose_config(f"+experiment={name}")
        laid[cfg.model.path] = lay_model(cfg.model.path, model_dir)
        if cfg.data.path in datasets:  # one dataset serves two recipes
            continue
        datasets.add(cfg.data.path)
        lay_dataset(cfg.data.path, cfg.data.name or "default", {cfg.data.split: STAND_IN_ROWS[cfg.data.path]})
    return laid


def test_every_recipe_composes_names_its_hardware_and_sources_and_is_documented():
    docs = (ROOT / "docs" / "models-and-data.md").read_text()
    assert RECIPES == sorted(STAND_IN_RUNS)
    for name in RECIPES:
        cfg = compose_config(f"+experiment={name}")
        text = (ROOT / "conf" / "experiment" / f"{name}.yaml").read_text()
        assert "Meant for:" in text and "Where the settings come from:" in text, name
        assert f"+experiment={name}" in docs, name
        if name in HUB_RECIPES:
            assert "/" in cfg.model.path and "/" in cfg.data.path  # Hub ids, not local paths
        else:
            assert cfg.model.path is None and cfg.data.path is None  # the built-in tiny model and task
        named_by = {*name.split("_"), OBJECTIVE_OF.get(name)}
        assert cfg.algo.name in named_by or cfg.env.name in named_by  # named by its algorithm (or objective), or its env


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_with_its_stand_in_settings_passes_the_runs_checks(stand_ins, tmp_path, name):
    """What a run checks before it builds anything (rltrain/preflight/validate.py), for every recipe as
    its stand-in run composes it (a two-command recipe's first model: a tiny reward model, or the tiny
    model as the judge): the cheap half of the stand-in runs below."""
    from rltrain.models.tiny_reward import build_tiny_reward_model_dir
    from rltrain.preflight.validate import validate

    first = []
    if name == "rm_then_ppo":
        first = [f"reward_model.path={build_tiny_reward_model_dir(tmp_path / 'rm')}"]
    if name == "judge_then_grpo":
        first = [f"reward_model.path={stand_ins['Qwen/Qwen2.5-0.5B-Instruct']}"]
    validate(compose_config(f"+experiment={name}", *STAND_IN_RUNS[name], *first))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in RUN_ELSEWHERE else n for n in RECIPES])
def test_each_recipe_runs_offline_on_its_stand_ins(stand_ins, tmp_path, name):
    run_dir = tmp_path / "run"
    first = []
    if name == "rm_then_ppo":  # the first of the recipe's two commands
        rltrain("algo=rm", "model=tiny", *SMALL_MODEL, *CPU, "trainer.max_steps=2", "trainer.global_batch_size=4",
                "data.num_eval=4", run_dir=tmp_path / "rm")
        first = [f"reward_model.path={tmp_path / 'rm' / 'final'}"]
    if name == "judge_then_grpo":  # the first of the recipe's two commands: rows written, then an SFT
        made = python("-m", "rltrain.rewards.judge.tiny_judge", *SMALL_MODEL, *CPU, "trainer.max_steps=2",
                      "data.max_eval_samples=8", f"hydra.run.dir={tmp_path / 'judge'}")
        assert made.returncode == 0, made.stderr[-3000:]
        first = [f"reward_model.path={tmp_path / 'judge' / 'final'}"]
    proc = rltrain(f"+experiment={name}", *STAND_IN_RUNS[name], *first, run_dir=run_dir)
    steps = int(next(a for a in STAND_IN_RUNS[name] if a.startswith("trainer.max_steps=")).split("=")[1])
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    if name in HUB_RECIPES:
        assert f"rltrain: model {stand_ins['Qwen/Qwen2.5-0.5B-Instruct']}" in proc.stdout  # the id's cached snapshot
        assert "path: Qwen/Qwen2.5-0.5B-Instruct" in (run_dir / "config.yaml").read_text()  # the id, as given
    if name == "grpo_gsm8k":  # columns, the map and the math reward: a missing column would have stopped it
        assert all(0.0 <= r["reward/accuracy"] <= 1.0 for r in rows)
    if name == "rm_then_ppo":  # trained on the reward model's score; the task's reward logged beside it, weight 0
        assert all(math.isfinite(r["reward/model"]) and 0.0 <= r["reward/addition_reward"] <= 1.0 for r in rows)
    if name == "judge_then_grpo":  # scored by the served judge alone: its verdicts all read, none lost
        assert all(r["reward/judge"] == pytest.approx(r["reward/mean"], abs=1e-9) and 0.0 <= r["reward/judge"] <= 1.0 for r in rows)
        assert all(r["reward/judge_timeouts"] == r["reward/judge_errors"] == r["reward/judge_unparsed"] == 0.0 for r in rows)
        assert "judge-server-rank0.log" in {p.name for p in run_dir.iterdir()}
    if name == "grpo_calculator":  # episodes with the built-in tool, scored by exact match on the product
        assert all("env/tool_calls_mean" in r and 0.0 <= r["reward/exact_match"] <= 1.0 for r in rows)
    if name == "grpo_vision":  # the pictures' questions, scored by exact match on the colour
        assert all(0.0 <= r["reward/exact_match"] <= 1.0 and r["rollout/logprob_diff_max"] < 1e-3 for r in rows)
    if name == "grpo_code":  # the functions run against their hidden asserts in the sandbox
        assert all(r["reward/code_pass_rate"] == r["reward/tests_pass"] and r["reward/timeouts"] == 0.0 for r in rows)
    if name == "grpo_moe":  # sampled by the transformers engine, whose routing every trainer forward replays
        assert all(0.9 <= r["moe/router_agreement"] <= 1.0 and r["rollout/logprob_diff_max"] < 1e-3 for r in rows)
    if name == "agent_calculator":  # episodes played by the OpenAI-client agent, scored by what it returns
        assert all(r["env/turns_mean"] >= 1.0 and r["env/errors"] == 0.0 and 0.0 <= r["reward/env"] <= 1.0 for r in rows)
