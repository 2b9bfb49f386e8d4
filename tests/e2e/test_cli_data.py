"""User data through `data.path`: formats that work, and bad input that gets a clear message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli import QUICK, rltrain, train_rows

pytestmark = pytest.mark.e2e

ROWS = [{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in range(40)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _train(tmp_path: Path, data_path: Path, *extra: str):
    run_dir = tmp_path / "run"
    rltrain("algo=sft", f"data.path={data_path}", "trainer.max_steps=2", "trainer.global_batch_size=4", *QUICK, *extra,
            run_dir=run_dir)
    return train_rows(run_dir)


def test_jsonl_parquet_and_saved_dataset_all_train(tiny_cache, tmp_path):
    import datasets

    rows = _train(tmp_path / "a", write_jsonl(tmp_path / "d.jsonl", ROWS))
    assert len(rows) == 2
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    assert len(_train(tmp_path / "b", tmp_path / "d.parquet")) == 2
    ds.save_to_disk(str(tmp_path / "saved"))
    assert len(_train(tmp_path / "c", tmp_path / "saved")) == 2


def test_conversational_messages_use_the_chat_template(tiny_cache, tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": f"{a}+1?"}, {"role": "assistant", "content": str(a + 1)}]}
        for a in range(30)
    ]
    assert len(_train(tmp_path, write_jsonl(tmp_path / "m.jsonl", rows))) == 2


def _fails(tmp_path: Path, *args: str) -> str:
    proc = rltrain("algo=sft", *args, *QUICK, "trainer.max_steps=1", run_dir=tmp_path / "run", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "final").exists()
    return proc.stderr


def test_missing_file_is_named(tmp_path):
    err = _fails(tmp_path, f"data.path={tmp_path / 'nope.jsonl'}")
    assert "data.path" in err and "does not exist" in err


def test_missing_column_is_named(tiny_cache, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"question": "1+1=", "answer": "2"}] * 5)
    err = _fails(tmp_path, f"data.path={path}")
    assert "prompt/completion" in err and "question" in err


def test_empty_dataset_is_reported(tiny_cache, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    err = _fails(tmp_path, f"data.path={path}")
    assert "data.path" in err


def test_overlong_rows_are_dropped_and_counted_or_refused(tiny_cache, tmp_path):
    rows = ROWS + [{"prompt": "1+1=", "completion": "2" * 300}] * 3
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    trained = _train(tmp_path / "ok", path, "data.max_length=64", "data.eval_fraction=0")
    assert trained[0]["data/overlong_dropped"] == 3
    err = _fails(tmp_path / "strict", f"data.path={path}", "data.max_length=64", "data.overlong=error")
    assert "data.max_length=64" in err
