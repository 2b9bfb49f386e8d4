"""Read an offline W&B run file (`run-*.wandb`): a LevelDB-style log of protobuf records.

Used by tests to check that what W&B received equals metrics.jsonl, straight from W&B's own file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7  # ":W&B" + 2-byte magic + 1-byte version
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(data: bytes) -> list[bytes]:
    out, partial, pos = [], b"", HEADER
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            pos += (BLOCK - pos % BLOCK) % BLOCK
            continue
        chunk = data[pos : pos + length]
        pos += length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            partial = chunk
        elif kind == MIDDLE:
            partial += chunk
        elif kind == LAST:
            out.append(partial + chunk)
    return out


def read_offline_run(run_file: Path) -> dict:
    """{"group": str, "config": {...top-level keys...}, "history": {step: {key: value}}}"""
    from wandb.proto import wandb_internal_pb2 as pb

    result: dict = {"group": None, "config": {}, "history": {}}
    for raw in _records(run_file.read_bytes()):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            result["group"] = record.run.run_group
            for item in record.run.config.update:
                result["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            result["history"].setdefault(int(row["_step"]), {}).update(row)
    return result


def find_run_file(run_dir: Path) -> Path:
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no offline W&B run under {run_dir}"
    return files[-1]


def read_table(run_file: Path, history_row: dict, key: str) -> dict:
    """A `wandb.Table` logged under `key`: {"columns": [...], "data": [[...], ...]}, read from the
    file the history row points at (the offline run's `files/media/table/...`)."""
    assert history_row.get(f"{key}/_type") == "table-file", f"{key} is not a table in {sorted(history_row)}"
    return json.loads((run_file.parent / "files" / history_row[f"{key}/path"]).read_text())
