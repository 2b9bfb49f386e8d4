"""Laying models and datasets into the test session's Hugging Face caches, in the layout the real
downloads leave, so Hub ids resolve offline (conftest.py sets HF_HOME and HF_HUB_OFFLINE=1).

Models: `$HF_HUB_CACHE/models--ORG--NAME/{blobs,snapshots/COMMIT,refs/REVISION}` as huggingface_hub
writes them. Datasets: the prepared Arrow copy `datasets` keeps under `$HF_DATASETS_CACHE/ORG___NAME/
CONFIG/0.0.0/HASH`, which is what `load_dataset(id)` reads offline.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def lay_model(repo_id: str, source: Path, revision: str = "main") -> Path:
    """Copy the model directory `source` into the hub cache as `repo_id` at `revision`; its
    snapshot directory."""
    from huggingface_hub import constants

    repo = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    files = sorted(p for p in source.rglob("*") if p.is_file())
    commit = hashlib.sha1(b"".join(p.read_bytes() for p in files) + revision.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for path in files:
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            _publish(blob, data)
        link = snapshot / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # another worker laid the same file
            link.symlink_to(os.path.relpath(blob, link.parent))
    _publish(repo / "refs" / revision, commit.encode())
    return snapshot


def _publish(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: pytest-xdist workers may lay the same model at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def lay_dataset(repo_id: str, config: str, splits: dict[str, list[dict]]) -> Path:
    """Prepare `splits` as configuration `config` of the Hub dataset `repo_id` in the datasets cache,
    as `load_dataset(repo_id, config)` leaves it after a download; its directory."""
    import datasets
    from datasets import config as ds_config
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.parquet.parquet import Parquet

    namespace, _, name = repo_id.rpartition("/")
    folder = camelcase_to_snakecase(name)  # as datasets names it (trl-lib/Capybara -> trl-lib___capybara)
    target = Path(ds_config.HF_DATASETS_CACHE) / (f"{namespace}___{folder}" if namespace else folder) / config
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for split, rows in splits.items():
            files[split] = str(Path(tmp) / f"{split}.parquet")
            datasets.Dataset.from_list(rows).to_parquet(files[split])
        builder = Parquet(cache_dir=str(Path(tmp) / "built"), dataset_name=name, config_name=config, data_files=files,
                          hash=hashlib.sha256(repr(splits).encode()).hexdigest()[:16])
        builder.download_and_prepare()
        built = next((Path(tmp) / "built" / folder).iterdir())  # CONFIG-<data files hash>: a download names it CONFIG
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{config}.{os.getpid()}")
        shutil.move(str(built), str(staging))
        try:
            os.rename(staging, target)
        except OSError:  # another worker published it first
            shutil.rmtree(staging, ignore_errors=True)
    return target
