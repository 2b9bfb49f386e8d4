"""The preference formats (TRL's paired and unpaired ones, standard and conversational) as the
preference objectives read them, and the one-paragraph refusal of a dataset without the columns
its objective needs: each format named, with the columns it misses (rltrain.data.loading,
rltrain.data.unpaired_data). The CLI side: tests/e2e/test_cli_kto.py, tests/e2e/test_cli_dpo.py."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from rltrain.config.schema import DataConfig
from rltrain.data.loading import PAIRED, PAIRED_IMPLICIT, UNPAIRED, load_rows
from rltrain.data.preference_data import build_preference_data
from rltrain.data.unpaired_data import build_unpaired_data, unpaired_texts
from rltrain.models.tokenizer import build_char_tokenizer
from rltrain.runtime.errors import UserError

USER = {"role": "user", "content": "1+1?"}


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def data_cfg(**keys):
    cfg = OmegaConf.structured(DataConfig)
    for key, value in keys.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def write(tmp_path, rows, name="rows.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def refusal(path, needs) -> str:
    with pytest.raises(UserError) as info:
        load_rows("data.path", path, data_cfg(path=path), needs)
    return str(info.value)


def test_a_paired_objective_names_both_paired_forms_and_what_each_misses(tmp_path):
    path = write(tmp_path, [{"prompt": "1+1=", "chosen": "2", "answer": "2"}])
    message = refusal(path, [PAIRED, PAIRED_IMPLICIT])
    assert "has columns ['answer', 'chosen', 'prompt']" in message
    assert "prompt/chosen/rejected (TRL's paired preference format; missing rejected)" in message
    assert "chosen/rejected (paired with an implicit prompt" in message and "missing rejected)" in message
    assert "data.columns" in message and "\n" not in message


def test_unpaired_data_given_to_a_paired_objective_points_at_kto(tmp_path):
    path = write(tmp_path, [{"prompt": "1+1=", "completion": "2", "label": True}])
    message = refusal(path, [PAIRED, PAIRED_IMPLICIT])
    assert "missing chosen, rejected" in message
    assert "the unpaired format (prompt/completion/label), which algo=kto trains on" in message


def test_kto_names_the_unpaired_format_and_its_missing_label(tmp_path):
    path = write(tmp_path, [{"prompt": "1+1=", "completion": "2"}])
    message = refusal(path, [UNPAIRED, PAIRED, PAIRED_IMPLICIT])
    assert "prompt/completion/label (TRL's unpaired preference format: a boolean label per completion" in message
    assert "missing label)" in message and "missing chosen, rejected)" in message


def test_a_single_plain_option_keeps_its_short_form(tmp_path):
    path = write(tmp_path, [{"question": "1+1="}])
    assert "needs prompt. Map them with data.columns (e.g. data.columns.prompt=" in refusal(path, [("prompt",)])


def test_unpaired_rows_standard_and_conversational(tokenizer):
    assert unpaired_texts(tokenizer, {"prompt": "1+1=", "completion": "2", "label": False}, "here") == ("1+1=", "2", False)
    row = {"prompt": [USER], "completion": [{"role": "assistant", "content": "2"}], "label": True}
    assert unpaired_texts(tokenizer, row, "here") == ("U:1+1?\nA:", "2", True)
    for bad in (1, "true", None):
        with pytest.raises(UserError, match="column 'label' must hold booleans"):
            unpaired_texts(tokenizer, {"prompt": "1+1=", "completion": "2", "label": bad}, "here")


def test_kto_unpairs_paired_rows_and_pairs_held_out_rows_per_prompt(tokenizer, tmp_path):
    paired = [{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a + 3)} for a in range(6)]
    data = build_unpaired_data(tokenizer, data_cfg(path=write(tmp_path, paired), eval_fraction=0.0), seed=0)
    assert len(data.train) == 12 and sum(e.desirable for e in data.train) == 6
    unpaired = [{"prompt": f"{a}+1=", "completion": str(a + k), "label": k == 1} for a in range(4) for k in (1, 3)]
    unpaired.append({"prompt": "9+1=", "completion": "10", "label": True})  # no undesirable partner: no pair
    cfg = data_cfg(path=write(tmp_path, unpaired[:2]), eval_path=write(tmp_path, unpaired, "held_out.jsonl"))
    data = build_unpaired_data(tokenizer, cfg, seed=0)
    assert len(data.train) == 2 and len(data.eval) == 4
    eos = tokenizer.eos_token_id
    assert [(tokenizer.decode(p.chosen[:-1]), p.chosen[-1] == eos) for p in data.eval][:2] == [("1", True), ("2", True)]


def test_the_builtin_task_offers_unpaired_rows_from_its_pairs(tokenizer):
    cfg = data_cfg(num_eval=10)
    pairs = build_preference_data(tokenizer, cfg, seed=0)
    data = build_unpaired_data(tokenizer, cfg, seed=0)
    assert [(e.prompt, e.completion, e.desirable) for e in data.train[:2]] == [
        (pairs.train[0].prompt, pairs.train[0].chosen, True), (pairs.train[0].prompt, pairs.train[0].rejected, False)
    ]
    assert len(data.train) == 2 * len(pairs.train) and data.eval == pairs.eval and data.eval_answers == pairs.eval_answers
