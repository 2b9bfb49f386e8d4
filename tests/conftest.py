import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

# vLLM's CPU build: run the engine in-process with a small KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two pytest-xdist workers each start runs whose torch threads add up to more than the cores: an
# OpenMP thread that spins while it waits then steals the core another process needs, and a run
# takes several times as long. Waiting threads sleep instead; no number changes (docs/testing.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def session_dir(tmp_path_factory, name: str) -> Path:
    """A directory shared by the whole session: under pytest-xdist, by every worker (they share the
    parent of their base temp directories), so what one worker builds the others reuse."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """One tiny-model cache for the whole test session (builds are published by an atomic rename,
    so two workers building the same model is safe)."""
    path = Path(os.environ.get("RLTRAIN_TEST_CACHE", session_dir(tmp_path_factory, "rltrain_cache")))
    os.environ["RLTRAIN_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def shared_runs(tiny_cache, tmp_path_factory):
    """The session's shared runs (tests/cli.py, SharedRuns): one run per configuration."""
    from cli import SharedRuns

    return SharedRuns(session_dir(tmp_path_factory, "shared_runs"))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
