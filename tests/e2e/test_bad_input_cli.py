"""Bad input of every class gets one paragraph naming the fault and exit status 2, never a traceback.

Each case is a real `python -m rltrain ...` that must stop before training: a config value at
validation (no model is built), a data fault while the data loads (before the engine is built), and
a data fault found after the trainer's and the rollout engines are up, whose shutdown must add nothing.
Other classes have their own tests: a missing data file or column, an empty dataset and an
overlong row (test_cli_data.py), a broken reward function (test_cli_grpo.py), megatron layouts
(test_megatron_cli.py). Every enum-like key is checked in tests/unit/preflight/test_validate_choices.py.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from cli import QUICK, SMALL_MODEL, rltrain

pytestmark = pytest.mark.e2e


def _conversation(a: int, **changes) -> dict:
    return {"messages": [{"role": "user", "content": f"{a}+1?"}, {"role": "assistant", "content": str(a + 1)}], **changes}


def _user_turn(**fields) -> list[dict]:
    return [fields, {"role": "assistant", "content": "2"}]


# (name, rows of an SFT data file (None: no data file), overrides, substrings the message must hold)
CASES = [
    # the five malformed shapes of the conversational `messages` column
    ("messages_not_a_list", [{"messages": f"user: {a}+1?"} for a in range(8)], [],
     ["'messages' column holds str", "a non-empty list of messages"]),
    ("message_without_role", [{"messages": _user_turn(content=f"{a}+1?")} for a in range(8)], [],
     ["message 0", "lacks 'role'"]),
    ("message_without_content", [{"messages": _user_turn(role="user")} for a in range(8)], [],
     ["message 0", "lacks 'content'"]),
    ("unknown_role", [{"messages": _user_turn(role="robot", content=f"{a}+1?")} for a in range(8)], [],
     ["unknown role 'robot'", "system, user, assistant, tool"]),
    ("non_string_content", [{"messages": _user_turn(role="user", content=a)} for a in range(8)], [],
     ["message 0 whose content is int", "not a string"]),
    ("empty_messages", [{"messages": []} for _ in range(8)], [], ["holds an empty list"]),
    ("conversation_without_a_prompt", [{"messages": [{"role": "assistant", "content": "2"}]} for _ in range(8)], [],
     ["must end with the assistant's message", "['assistant']"]),
    # other data faults
    ("unknown_file_format", None, ["data.path={tmp}/rows.csv"], ["unknown format '.csv'"]),
    ("missing_split", None, ["data.path={tmp}/saved", "data.split=validation"], ["data.split='validation'", "['train']"]),
    ("num_eval_out_of_range", None, ["data.num_eval=0"], ["data.num_eval=0", "between 1 and 9999"]),
    ("unknown_task", None, ["data.task=division"], ["data.task='division'", "addition", "multiplication"]),
    # a model directory without tokenizer files
    ("model_without_tokenizer", None, ["model.path={tmp}/model"], ["has no tokenizer", "tokenizer.json", "vocab.json"]),
    ("model_config_not_json", None, ["model.path={tmp}/model"], ["config.json could not be read as JSON"]),
    ("tiny_model_heads", None, ["model.num_heads=3"], ["model.hidden_size=128", "model.num_heads=3"]),
    # enum-like keys, named with their allowed values (algorithm-specific ones under their algorithm)
    ("loss_agg", None, ["algo=grpo", "algo.loss_agg=tokenmean"],
     ["algo.loss_agg='tokenmean'", "token_mean, seq_mean_token_mean, seq_mean_token_sum_norm"]),
    ("scale_rewards", None, ["algo=grpo", "algo.scale_rewards=std"], ["algo.scale_rewards='std'", "group, batch, none"]),
    ("dpo_loss", None, ["algo=dpo", "algo.loss=sigmod"], ["algo.loss='sigmod'", "sigmoid, ipo, hinge, robust"]),
    # the key's name before `algo.loss`: Hydra's refusal names the new one
    ("renamed_dpo_loss", None, ["algo=dpo", "algo.loss_type=ipo"], ["unknown config key 'algo.loss_type'", "Did you mean algo.loss?"]),
    ("overlong", None, ["data.overlong=cut"], ["data.overlong='cut'", "drop, truncate, error"]),
    ("precision", None, ["trainer.precision=fp16"], ["trainer.precision='fp16'", "auto, fp32, bf16-mixed, bf16"]),
    ("rollout_process", None, ["algo=grpo", "rollout.process=forked"], ["rollout.process='forked'", "colocated, separate"]),
    ("schedule", None, ["optim.schedule=step"], ["optim.schedule='step'", "cosine, linear, constant"]),
    ("judge_key_unset", None, ["algo=grpo", "reward_model=judge", "reward_model.url=http://127.0.0.1:9/v1", "reward_model.model=m",
                               "reward_model.api_key_env=RLTRAIN_TEST_UNSET_JUDGE_KEY"],
     ["reward_model.api_key_env='RLTRAIN_TEST_UNSET_JUDGE_KEY'", "not set"]),
]


def _prepare(tmp_path: Path, rows: list[dict] | None, name: str) -> list[str]:
    import datasets

    args = []
    if rows is not None:
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        args.append(f"data.path={path}")
    (tmp_path / "rows.csv").write_text("prompt,completion\n1+1=,2\n")
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "1+1=", "completion": "2"}])}).save_to_disk(
        str(tmp_path / "saved")
    )
    model = tmp_path / "model"  # what a save of the weights alone leaves: config and weights, no tokenizer
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    (model / "model.safetensors").write_bytes(b"")
    if name == "model_config_not_json":  # a config.json cut short by an interrupted copy
        (model / "config.json").write_text('{"model_type": "qwen2", "hidden')
    return args


@pytest.mark.parametrize("name, rows, overrides, names", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_one_paragraph_and_exit_2(tiny_cache, tmp_path, name, rows, overrides, names):
    args = _prepare(tmp_path, rows, name) + [o.format(tmp=tmp_path) for o in overrides]
    algo = [] if any(a.startswith("algo=") for a in args) else ["algo=sft"]
    run_dir = tmp_path / "run"
    proc = rltrain(*algo, *args, *QUICK, "trainer.max_steps=1", run_dir=run_dir, timeout=240, check=False)
    err = proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}\n{err[-4000:]}"
    assert "Traceback" not in err, err[-4000:]
    lines = [line for line in err.splitlines() if line.startswith("rltrain: error: ")]
    assert len(lines) == 1, err[-4000:]  # one paragraph: a single line, printed once
    for part in names:
        assert part in lines[0], lines[0]
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()


SEPARATE_ENGINE = pytest.mark.xdist_group("separate_engine")  # its cleanup is counted (test_cli_async.py)


@pytest.mark.parametrize("rollout, backend", [
    (["rollout=vllm"], "fsdp"),
    pytest.param(["rollout=vllm"], "megatron", marks=pytest.mark.slow),
    pytest.param(["rollout=vllm", "rollout.process=separate"], "fsdp", marks=SEPARATE_ENGINE),
    pytest.param(["rollout=vllm", "rollout.process=separate"], "megatron", marks=[SEPARATE_ENGINE, pytest.mark.slow]),
    pytest.param(["rollout=hf"], "fsdp", marks=pytest.mark.slow),
    (["rollout=hf"], "megatron"),
], ids=["vllm-fsdp", "vllm-megatron", "separate-fsdp", "separate-megatron", "hf-fsdp", "hf-megatron"])
def test_a_user_error_after_the_engines_are_up_is_one_paragraph(tiny_cache, tmp_path, rollout, backend):
    """Every rollout engine kind (vLLM in process, vLLM in its own process, HF) on both backends, one
    rank (in `make test` each engine kind once and each backend at least once; the rest `slow`): the prompts, read after the engines are built, are all longer than data.max_length. The
    algorithm closes what it built before the process group goes (rltrain/algos/rl/algorithm.py), so no
    engine's exit-time shutdown prints a traceback (vLLM's destroyed a group already gone) and a
    separate engine leaves no socket directory behind."""
    sockets_before = set(Path(tempfile.gettempdir()).glob("rlsep-*"))
    proc = rltrain("algo=grpo", *rollout, f"backend={backend}", "data.max_length=2", "algo.prompts_per_step=2",
                   "algo.group_size=2", *SMALL_MODEL, *QUICK, "trainer.max_steps=1", run_dir=tmp_path / "run",
                   timeout=240, check=False)
    err = proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}\n{err[-4000:]}"
    assert "Traceback" not in err, err[-4000:]
    lines = [line for line in err.splitlines() if line.startswith("rltrain: error: ")]
    assert lines == ["rltrain: error: built-in task: no prompts left (all longer than data.max_length=2)."], err[-4000:]
    if "rollout.process=separate" in rollout:  # counted only where no other test's engine runs beside it
        assert set(Path(tempfile.gettempdir()).glob("rlsep-*")) <= sockets_before
