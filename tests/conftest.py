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


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """One tiny-model cache for the whole test session."""
    path = Path(os.environ.get("RLTRAIN_TEST_CACHE", tmp_path_factory.mktemp("rltrain_cache")))
    os.environ["RLTRAIN_CACHE"] = str(path)
    return path


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
