"""Hub datasets and reshaping (rltrain.data.loading): a dataset laid into the `datasets` cache and
loaded offline by id, configuration and split; `data.columns` and `data.map_fn`; and the messages
bad input gets."""

from __future__ import annotations

import pytest
from hub_cache import lay_dataset
from omegaconf import OmegaConf

from rltrain.config.schema import DataConfig
from rltrain.data.loading import is_dataset_id, load_rows, train_and_eval_rows
from rltrain.runtime.errors import UserError

GSM_LIKE = {
    "train": [{"question": f"What is {a} + {a}?", "answer": f"{a} + {a} = {2 * a}\n#### {2 * a}"} for a in range(20)],
    "test": [{"question": "What is 1 + 2?", "answer": "1 + 2 = 3\n#### 3"}],
}
PROMPT = [("prompt",)]


def data_cfg(**keys):
    cfg = OmegaConf.structured(DataConfig)
    for key, value in keys.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def final_answer(row: dict) -> dict:
    """A map function as a user writes one: GSM8K's answer after its mark."""
    return {"solution": row["answer"].split("####")[-1].strip()}


def test_a_hub_dataset_loads_offline_by_id_configuration_and_split():
    lay_dataset("test-org/gsm-like", "main", GSM_LIKE)
    assert is_dataset_id("test-org/gsm-like") and not is_dataset_id("rows.jsonl")
    cfg = data_cfg(path="test-org/gsm-like", name="main", split="test", **{"columns.prompt": "question"})
    rows = load_rows("data.path", cfg.path, cfg, PROMPT).to_list()
    assert rows == [{"question": "What is 1 + 2?", "answer": "1 + 2 = 3\n#### 3", "prompt": "What is 1 + 2?"}]


def test_columns_then_map_fn_give_the_conventional_columns():
    lay_dataset("test-org/gsm-like", "main", GSM_LIKE)
    cfg = data_cfg(path="test-org/gsm-like", name="main", map_fn=f"{__name__}:final_answer", **{"columns.prompt": "question"})
    train, held_out, where = train_and_eval_rows(cfg, seed=0, needs=PROMPT)
    assert len(train) == 19 and len(held_out) == 1 and where == "data.path='test-org/gsm-like'"
    by_question = {r["question"]: r for r in train + held_out}
    assert by_question["What is 7 + 7?"]["prompt"] == "What is 7 + 7?" and by_question["What is 7 + 7?"]["solution"] == "14"


def test_the_builtin_gsm8k_map_makes_a_chat_prompt():
    lay_dataset("test-org/gsm-like", "main", GSM_LIKE)
    cfg = data_cfg(path="test-org/gsm-like", name="main", split="test", map_fn="rltrain.data.row_maps:gsm8k_prompt",
                   **{"columns.prompt": "question", "columns.solution": "answer"})
    (row,) = load_rows("data.path", cfg.path, cfg, PROMPT).to_list()
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].startswith("What is 1 + 2? ")
    assert "####" in row["prompt"][0]["content"] and row["solution"] == row["answer"]


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({"name": "other"}, ["'other'", "['main']", "set data.name to one"]),  # the cached configurations listed
        ({"name": "main", "split": "validation"}, ["'validation'", "set data.split to one"]),
        ({"path": "test-org/never-laid"}, ["test-org/never-laid", "HF_HUB_OFFLINE=1", "save_to_disk"]),
    ],
)
def test_what_cannot_be_loaded_is_named_with_the_fix(keys, expected):
    lay_dataset("test-org/gsm-like", "main", GSM_LIKE)
    cfg = data_cfg(**{"path": "test-org/gsm-like", **keys})
    with pytest.raises(UserError) as info:
        load_rows("data.path", cfg.path, cfg, PROMPT)
    assert "could not be loaded as a Hugging Face Hub dataset" in str(info.value)
    for text in expected:
        assert text in str(info.value)


def test_bad_reshaping_is_named(tmp_path):
    lay_dataset("test-org/gsm-like", "main", GSM_LIKE)
    base = {"path": "test-org/gsm-like", "name": "main"}
    with pytest.raises(UserError, match=r"data.columns names \['query'\]: data.columns.prompt=query"):
        load_rows("data.path", "test-org/gsm-like", data_cfg(**base, **{"columns.prompt": "query"}), PROMPT)
    with pytest.raises(UserError, match=r"needs prompt. Map them with data.columns \(e.g. data.columns.prompt="):
        load_rows("data.path", "test-org/gsm-like", data_cfg(**base), PROMPT)
    with pytest.raises(UserError, match=r"data.map_fn='[\w.]+:raises' raised KeyError: 'nope' on row 0"):
        load_rows("data.path", "test-org/gsm-like", data_cfg(**base, map_fn=f"{__name__}:raises"), PROMPT)
    with pytest.raises(UserError, match="returned list for row 0.*must return a dict"):
        load_rows("data.path", "test-org/gsm-like", data_cfg(**base, map_fn=f"{__name__}:returns_a_list"), PROMPT)
    with pytest.raises(UserError, match="data.map_fn 'no.such.module:fn' could not be loaded"):
        load_rows("data.path", "test-org/gsm-like", data_cfg(**base, map_fn="no.such.module:fn"), PROMPT)


def raises(row: dict) -> dict:
    return {"x": row["nope"]}


def returns_a_list(row: dict) -> list:
    return [row]


def test_a_hub_key_with_a_local_file_is_refused(tmp_path):
    from helpers import compose_config

    from rltrain.preflight.validate import validate

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1=", "completion": "2"}\n')
    with pytest.raises(UserError, match="data.name='main' is set but data.path=.* is not a Hub dataset id"):
        validate(compose_config("algo=sft", f"data.path={rows}", "data.name=main"))
