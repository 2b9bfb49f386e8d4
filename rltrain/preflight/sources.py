"""Where a run's models and data come from, checked before anything is built: each model key a
Hugging Face directory or Hub id (resolved here, so a download happens once, in the launcher) with a
tokenizer beside its config.json, each `*.revision` only with an id, and `data.path` /
`data.eval_path` an existing file or a Hub dataset (fetched here). docs/models-and-data.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from rltrain.config.schema import DataConfig
from rltrain.runtime.errors import UserError

# Files of which a tokenizer directory has at least one (fast tokenizer, sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def read_hf_config(key: str, value: str, unset_hint: str, revision: str | None = None) -> dict:
    """config.json of the Hugging Face model directory (or Hub id, fetched here: rltrain/config/hub.py)
    `value` given as `key`, checked to be one: config.json with a `model_type`, and a tokenizer beside
    it. `unset_hint` says what the key's null means (the fix that needs no directory)."""
    from rltrain.config.hub import local_model_dir

    directory = local_model_dir(key, value, revision)
    if not (directory / "config.json").exists() and (directory / "adapter_config.json").exists():
        raise UserError(
            f"{key}={value!r} is a PEFT adapter directory (a LoRA run's final/), not a model. Point {key} at the "
            "merged model beside it (final/merged/, written with model.lora.save_merged=true), or merge the adapter "
            "into its base with peft (PeftModel.from_pretrained(base, dir).merge_and_unload())."
        )
    if not (directory / "config.json").exists():
        raise UserError(
            f"{key}={value!r} is not a Hugging Face model directory (no config.json). Point it at a "
            f"directory written by save_pretrained, or {unset_hint}."
        )
    try:
        hf_config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{key}={value!r}: config.json could not be read as JSON ({exc}).") from None
    if not isinstance(hf_config, dict) or "model_type" not in hf_config:
        raise UserError(
            f"{key}={value!r}: config.json has no 'model_type', so transformers cannot tell which "
            f"architecture to build. Point {key} at a directory written by save_pretrained."
        )
    if not any((directory / name).exists() for name in TOKENIZER_FILES) and not any(directory.glob("*.tiktoken")):
        raise UserError(
            f"{key}={value!r} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} (or a *.tiktoken "
            "file) is there, and without one transformers silently builds a tokenizer of a few special tokens. "
            f"Save the model's tokenizer into the same directory (tokenizer.save_pretrained({key.split('.')[0]}_path))."
        )
    return hf_config


def validate_model_source(prefix: str, group, unset_hint: str) -> None:
    """`{prefix}.path` a usable model directory or Hub id, and `{prefix}.revision` only with an id."""
    check_revision(prefix, group)
    if group.path is not None:
        read_hf_config(f"{prefix}.path", group.path, unset_hint, group.revision)


def check_revision(prefix: str, group) -> None:
    """`{prefix}.revision` only where `{prefix}.path` names a Hub id."""
    from rltrain.config.hub import names_hub_id

    if group.revision is None:
        return
    if group.path is None or not names_hub_id(group.path):
        raise UserError(
            f"{prefix}.revision={group.revision!r} picks a version of a Hub id, but {prefix}.path={group.path!r} is not one. "
            f"Remove {prefix}.revision, or set {prefix}.path to the model's Hub id (org/name)."
        )


def validate_data_sources(data: DataConfig) -> None:
    """`data.path` and `data.eval_path` exist, or name Hub datasets, which are fetched here (with
    datasets' progress bars) so a wrong id, configuration or split fails before any model is built
    and the ranks read the prepared copy from the cache."""
    from rltrain.data.loading import DATA_SUFFIXES, is_dataset_id, load_hub_dataset

    sources = {"data.path": data.path, "data.eval_path": data.eval_path}
    hub = {key for key, value in sources.items() if value is not None and is_dataset_id(value)}
    for key, value in (("data.name", data.name), ("data.revision", data.revision)):
        if value is not None and not hub:
            picks = "configuration" if key == "data.name" else "version"
            raise UserError(
                f"{key}={value!r} is set but data.path={data.path!r} is not a Hub dataset id: {key} picks a Hub "
                f"dataset's {picks}. Remove it, or name the dataset by its id (org/name)."
            )
    for key, value in sources.items():
        if value is None:
            continue
        if key in hub:
            load_hub_dataset(key, value, data, progress=True)
        elif not Path(value).expanduser().exists():
            raise UserError(
                f"{key}={value!r} does not exist. Give a .jsonl or .parquet file, a directory saved with datasets' "
                "save_to_disk, or a Hugging Face Hub dataset id (org/name)."
            )
        elif Path(value).expanduser().is_file() and Path(value).suffix not in DATA_SUFFIXES:
            raise UserError(
                f"{key}={value!r}: unknown format {Path(value).suffix!r}. Use .jsonl, .parquet or a saved dataset "
                "directory."
            )
