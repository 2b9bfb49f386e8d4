"""Loading user datasets (`data.path`) with `datasets`, and turning bad input into clear errors.

Accepted: a `.jsonl`/`.json` file, a `.parquet` file, or a directory written by
`Dataset.save_to_disk` / `DatasetDict.save_to_disk`. Columns follow TRL's conventions; which ones
are needed depends on the algorithm (`prompt`/`completion`, `prompt`/`chosen`/`rejected`,
`messages`, or `prompt` alone for online RL).
"""

from __future__ import annotations

from pathlib import Path

from rltrain.runtime.errors import UserError


def load_rows_dataset(path: str, split: str):
    """A `datasets.Dataset` from `path`, or a UserError naming the problem and the fix."""
    import datasets

    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(
            f"data.path={path!r} does not exist. Give a .jsonl or .parquet file, or a directory saved with "
            "datasets' save_to_disk (or leave data.path unset to use the built-in task)."
        )
    datasets.disable_progress_bars()
    try:
        if p.is_dir():
            loaded = datasets.load_from_disk(str(p))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise UserError(
                        f"data.path={path!r} holds splits {sorted(loaded)} but data.split={split!r}; "
                        "set data.split to one of them."
                    )
                loaded = loaded[split]
            ds = loaded
        elif p.suffix in (".jsonl", ".json"):
            ds = datasets.load_dataset("json", data_files=str(p), split="train")
        elif p.suffix == ".parquet":
            ds = datasets.load_dataset("parquet", data_files=str(p), split="train")
        else:
            raise UserError(
                f"data.path={path!r}: unknown format {p.suffix!r}. Use .jsonl, .parquet or a saved dataset directory."
            )
    except UserError:
        raise
    except Exception as exc:  # datasets raises many types for unreadable input
        raise UserError(f"data.path={path!r} could not be read: {type(exc).__name__}: {exc}") from exc
    if len(ds) == 0:
        raise UserError(f"data.path={path!r} holds no rows; give a dataset with at least one example.")
    return ds


def require_columns(ds, path: str, options: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The first column set in `options` that `ds` has; otherwise a UserError listing them."""
    columns = set(ds.column_names)
    for option in options:
        if set(option) <= columns:
            return option
    wanted = " or ".join("/".join(o) for o in options)
    raise UserError(
        f"data.path={path!r} has columns {sorted(columns)} but this algorithm needs {wanted}. "
        "Rename the columns (TRL conventions) or pick the matching algo=."
    )
