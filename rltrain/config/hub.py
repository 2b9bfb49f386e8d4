"""Hugging Face Hub ids wherever a model is named: `model.path`, `reference.path`, `critic.path`
and `reward_model.path` take a local directory or a Hub id (`org/name`), pinned with the group's
`revision` key.

An id resolves through huggingface_hub's cache: downloaded (with its progress bars) when the Hub
can be reached, read from the cache when it cannot or when `HF_HUB_OFFLINE=1`. A local directory
of the same name wins, so a relative path that exists is never mistaken for an id. The launcher's
validation resolves first (it reads config.json before anything is built), so ranks find the
snapshot cached. docs/models-and-data.md.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

from rltrain.runtime.errors import UserError

# Formats rltrain never reads (TensorFlow, Flax, ONNX, GGUF, original checkpoints): not downloaded.
IGNORED_FILES = ["*.h5", "*.msgpack", "*.onnx", "*.onnx_data", "*.gguf", "*.ot", "*.tflite", "original/*"]


def is_hub_id(value: str) -> bool:
    """`value` has the form of a Hub repository id (`name` or `org/name`) and not of a path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if value.startswith(("/", ".", "~")) or value.count("/") > 1 or "\\" in value:
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def names_hub_id(value: str) -> bool:
    """`value` is taken as a Hub id: nothing of that name exists here, and it has an id's form."""
    return not Path(value).expanduser().exists() and is_hub_id(value)


def local_model_dir(key: str, value: str, revision: str | None) -> Path:
    """The directory `key=value` names: `value` itself when it exists or is not an id, else the
    Hub snapshot of `value` at `revision` (a UserError naming the id and the fixes when it can
    neither be downloaded nor found in the cache)."""
    return _snapshot(key, value, revision) if names_hub_id(value) else Path(value).expanduser()


def model_identity(value: str, revision: str | None) -> str:
    """How a checkpoint records the model: a local directory's absolute path, or `id@revision`."""
    return f"{value}@{revision or 'main'}" if names_hub_id(value) else str(Path(value).expanduser().resolve())


@cache
def _snapshot(key: str, repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, ignore_patterns=IGNORED_FILES))
    except Exception as exc:  # noqa: BLE001 - huggingface_hub raises many types; each becomes one message
        raise UserError(hub_failure(key, repo_id, revision, exc, constants.HF_HUB_OFFLINE, constants.HF_HUB_CACHE)) from None


def hub_failure(key: str, repo_id: str, revision: str | None, exc: Exception, offline: bool, cache_dir: str) -> str:
    """Why `repo_id` could not be had, and both fixes: get it into the cache, or name a directory."""
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    if isinstance(exc, GatedRepoError):
        reason = "the Hub refused it (a gated model: accept its terms on its Hub page and log in with `hf auth login`)"
    elif isinstance(exc, RepositoryNotFoundError):
        reason = "the Hub has no such model (or it is private: log in with `hf auth login`)"
    elif isinstance(exc, RevisionNotFoundError):
        reason = f"the Hub has no revision {revision!r} of it"
    elif isinstance(exc, LocalEntryNotFoundError) and offline:
        reason = f"HF_HUB_OFFLINE=1 and it is not in the cache ({cache_dir})"
    elif isinstance(exc, LocalEntryNotFoundError):
        reason = f"the Hub could not be reached and it is not in the cache ({cache_dir})"
    else:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    rev_flag = f" --revision {revision}" if revision else ""
    home = f" ({os.environ['HF_HOME']})" if os.environ.get("HF_HOME") else ""
    online = ", without HF_HUB_OFFLINE=1" if offline else ""
    return (
        f"{key}={repo_id!r} is not a local directory, and as a Hugging Face Hub id{at} it could not be loaded: "
        f"{reason}. Either put it into the cache (`hf download {repo_id}{rev_flag}` on a machine that reaches the "
        f"Hub, with the same HF_HOME{home}; or run once with network access{online}), or point {key} at a local "
        "directory written by save_pretrained."
    )
