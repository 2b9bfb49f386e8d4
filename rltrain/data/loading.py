"""Loading user datasets (`data.path`) with `datasets`, and turning bad input into clear errors.

`data.path` is a `.jsonl`/`.json`/`.parquet` file, a directory written by `save_to_disk`, or a
Hugging Face Hub dataset id (`org/name`, with `data.name` and `data.split`; read from the
`datasets` cache when offline). `data.columns` then gives the rows the conventional column names
and `data.map_fn` reshapes each row (`datasets.map`). Columns follow TRL's conventions; which
ones are needed depends on the algorithm. docs/models-and-data.md.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

from rltrain.config.hub import names_hub_id
from rltrain.config.schema import DataColumns, DataConfig
from rltrain.runtime.errors import UserError
from rltrain.runtime.library_noise import quiet_datasets_offline_notes
from rltrain.runtime.user_code import load_callable

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")  # files read here (besides save_to_disk directories)


def is_dataset_id(path: str) -> bool:
    """`path` names a Hub dataset: no such local file or directory, and an id's form."""
    return Path(path).suffix not in DATA_SUFFIXES and names_hub_id(path)


def train_and_eval_rows(data_cfg: DataConfig, seed: int, needs: list[tuple[str, ...]]) -> tuple[list[dict], list[dict], str]:
    """(train rows, eval rows, where) of `data.path`: the eval rows are `data.eval_path`'s, else a
    seeded `data.eval_fraction` of the rows (at most `data.max_eval_samples`)."""
    assert data_cfg.path is not None, "a dataset is read only where data.path names one"
    where = f"data.path={data_cfg.path!r}"
    rows = load_rows("data.path", data_cfg.path, data_cfg, needs).to_list()
    if data_cfg.eval_path is not None:
        return rows, load_rows("data.eval_path", data_cfg.eval_path, data_cfg, needs).to_list(), where
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held = set(order[: min(int(len(rows) * data_cfg.eval_fraction), data_cfg.max_eval_samples)])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held], where


def eval_limit(data_cfg: DataConfig) -> int | None:
    """How many eval rows to keep: `data.max_eval_samples` of a dataset; all `data.num_eval` problems
    of the built-in task (its held-out size is already what the user chose)."""
    return None if data_cfg.path is None else data_cfg.max_eval_samples


def load_rows(key: str, path: str, data_cfg: DataConfig, needs: list[tuple[str, ...]]):
    """The `datasets.Dataset` that `key=path` names, with `data.columns` and `data.map_fn` applied
    and one of the column sets `needs` present; else a UserError naming the problem and the fix."""
    import datasets

    datasets.disable_progress_bars()
    quiet_datasets_offline_notes()
    ds = load_hub_dataset(key, path, data_cfg) if is_dataset_id(path) else load_local_dataset(key, path, data_cfg.split)
    ds = reshape(ds, key, path, data_cfg)
    if len(ds) == 0:
        raise UserError(f"{key}={path!r} holds no rows; give a dataset with at least one example.")
    require_columns(ds, key, path, needs)
    return ds


def load_local_dataset(key: str, path: str, split: str):
    import datasets

    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(
            f"{key}={path!r} does not exist. Give a .jsonl or .parquet file, a directory saved with datasets' "
            "save_to_disk, or a Hugging Face Hub dataset id (org/name)."
        )
    try:
        if p.is_dir():
            loaded = datasets.load_from_disk(str(p))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise UserError(
                        f"{key}={path!r} holds splits {sorted(loaded)} but data.split={split!r}; set data.split to one of them."
                    )
                loaded = loaded[split]
            return loaded
        if p.suffix in (".jsonl", ".json"):
            return datasets.load_dataset("json", data_files=str(p), split="train")
        if p.suffix == ".parquet":
            return datasets.load_dataset("parquet", data_files=str(p), split="train")
    except UserError:
        raise
    except Exception as exc:  # datasets raises many types for unreadable input
        raise UserError(f"{key}={path!r} could not be read: {type(exc).__name__}: {exc}") from exc
    raise UserError(f"{key}={path!r}: unknown format {p.suffix!r}. Use .jsonl, .parquet or a saved dataset directory.")


def load_hub_dataset(key: str, repo_id: str, data_cfg: DataConfig, progress: bool = False):
    """Split `data.split` of configuration `data.name` of the Hub dataset `repo_id`: downloaded and
    prepared by `datasets` (its progress bars with `progress`), or its prepared copy when offline."""
    import datasets

    if progress:
        datasets.enable_progress_bars()
    try:
        return datasets.load_dataset(repo_id, data_cfg.name, split=data_cfg.split, revision=data_cfg.revision)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types; each becomes one message
        raise UserError(hub_dataset_failure(key, repo_id, data_cfg, exc)) from None
    finally:
        datasets.disable_progress_bars()


def hub_dataset_failure(key: str, repo_id: str, data_cfg: DataConfig, exc: Exception) -> str:
    """What went wrong, in datasets' words, and the fix for that case."""
    from datasets import config

    detail = " ".join(str(exc).split()).rstrip(".")
    chosen = f"data.name={data_cfg.name!r}, data.split={data_cfg.split!r}" + (
        f", data.revision={data_cfg.revision!r}" if data_cfg.revision else ""
    )
    if "split" in detail.lower():
        fix = "set data.split to one of the dataset's splits"
    elif "config" in detail.lower() and ("available" in detail.lower() or "missing" in detail.lower()):
        fix = "set data.name to one of the dataset's configurations"
    elif config.HF_HUB_OFFLINE:
        fix = (
            f"HF_HUB_OFFLINE=1 reads datasets' prepared copies only ({config.HF_DATASETS_CACHE}): load it once with "
            "network access and the same HF_HOME, or save it with save_to_disk and point data.path at that directory"
        )
    else:
        fix = (
            "check the id, data.name (the configuration) and data.split on the dataset's Hub page (log in with "
            "`hf auth login` for a private or gated one), or give a local .jsonl/.parquet file"
        )
    return f"{key}={repo_id!r} ({chosen}) could not be loaded as a Hugging Face Hub dataset: {type(exc).__name__}: {detail}. Fix: {fix}."


def reshape(ds, key: str, path: str, data_cfg: DataConfig):
    """`data.columns` (each conventional column a copy of the named one, which stays) and then
    `data.map_fn` (one row in, the columns to set out), in one `datasets.map` pass."""
    named = {f.name: getattr(data_cfg.columns, f.name) for f in dataclasses.fields(DataColumns)}
    copies = {conv: source for conv, source in named.items() if source is not None}
    if missing := sorted({source for source in copies.values() if source not in ds.column_names}):
        raise UserError(
            f"{key}={path!r} has columns {sorted(ds.column_names)}, but data.columns names {missing}: "
            + ", ".join(f"data.columns.{c}={s}" for c, s in copies.items() if s in missing)
            + ". Name a column the dataset has."
        )
    fn = load_callable("data.map_fn", data_cfg.map_fn) if data_cfg.map_fn else None
    if not copies and fn is None:
        return ds

    def transform(row: dict, index: int) -> dict:
        for conv, source in copies.items():
            row[conv] = row[source]
        if fn is None:
            return row
        try:
            update: Any = fn(dict(row))
        except Exception as exc:
            raise UserError(
                f"data.map_fn={data_cfg.map_fn!r} raised {type(exc).__name__}: {exc} on row {index} of {key}={path!r} "
                f"(columns {sorted(row)})."
            ) from exc
        if not isinstance(update, dict):
            raise UserError(
                f"data.map_fn={data_cfg.map_fn!r} returned {type(update).__name__} for row {index} of {key}={path!r}; "
                "it must return a dict of the columns to set (e.g. {'solution': ...})."
            )
        return {**row, **update}

    try:
        return ds.map(transform, with_indices=True, load_from_cache_file=False, keep_in_memory=True)
    except UserError:
        raise
    except Exception as exc:  # datasets cannot store what the function returned
        raise UserError(
            f"data.map_fn={data_cfg.map_fn!r} on {key}={path!r}: {type(exc).__name__}: {exc}. Return the same columns, "
            "with values of one type, for every row."
        ) from exc


# TRL's preference formats, named (with the algorithms that read them) when a dataset lacks their
# columns: docs/models-and-data.md.
PAIRED = ("prompt", "chosen", "rejected")
PAIRED_IMPLICIT = ("chosen", "rejected")
UNPAIRED = ("prompt", "completion", "label")
FORMATS: dict[tuple[str, ...], str] = {
    PAIRED: "TRL's paired preference format",
    PAIRED_IMPLICIT: "paired with an implicit prompt: conversations whose messages before the last are the prompt",
    UNPAIRED: "TRL's unpaired preference format: a boolean label per completion, true for a desirable one",
}


def require_columns(ds, key: str, path: str, options: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The first column set in `options` that `ds` has; otherwise a UserError listing them, each
    preference format by name with the columns it misses."""
    columns = set(ds.column_names)
    for option in options:
        if set(option) <= columns:
            return option
    wanted = " or ".join(describe_option(option, columns, len(options) > 1) for option in options)
    raise UserError(
        f"{key}={path!r} has columns {sorted(columns)} but this algorithm needs {wanted}.{other_format_hint(columns, options)} "
        f"Map them with data.columns (e.g. data.columns.{options[0][0]}=YOUR_COLUMN) or data.map_fn, or pick the "
        "matching algo=."
    )


def describe_option(option: tuple[str, ...], columns: set[str], name_missing: bool) -> str:
    notes = [FORMATS[option]] if option in FORMATS else []
    if name_missing or notes:
        notes.append("missing " + ", ".join(c for c in option if c not in columns))
    return "/".join(option) + (f" ({'; '.join(notes)})" if notes else "")


def other_format_hint(columns: set[str], options: list[tuple[str, ...]]) -> str:
    """Where a dataset is in the other preference format: which algorithm reads it."""
    if set(UNPAIRED) <= columns and UNPAIRED not in options:
        return " The dataset is in the unpaired format (prompt/completion/label), which algo=kto trains on."
    if set(PAIRED_IMPLICIT) <= columns and PAIRED_IMPLICIT not in options and UNPAIRED in options:
        return " The dataset is in the paired format (chosen/rejected), which algo=dpo, simpo, orpo, rm and kto read."
    return ""
