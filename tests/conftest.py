import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

# Before any test module imports transformers, which decides once whether torchvision exists: rltrain
# makes the venv's side-folder torchvision importable (rltrain/runtime/torchvision_compat.py).
import rltrain  # noqa: F401  isort: skip

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
# No test touches the network: the Hugging Face libraries run offline, from caches of this test run
# (shared by its pytest-xdist workers, which inherit the id), where tests lay the models and
# datasets they name by Hub id (tests/hub_cache.py). Set before any of them is imported: they read
# these once.
os.environ["HF_HUB_OFFLINE"] = "1"
if "RLTRAIN_TEST_HF_HOME" not in os.environ:  # pytest's own process; its workers inherit the variable
    os.environ["RLTRAIN_TEST_HF_HOME"] = tempfile.mkdtemp(prefix="rltrain-tests-hf-")
    os.environ["RLTRAIN_TEST_HF_HOME_OWNER"] = str(os.getpid())
HF_HOME = Path(os.environ["RLTRAIN_TEST_HF_HOME"])
SUITE_STARTED = pytest.StashKey[float]()
os.environ["HF_HOME"] = str(HF_HOME)
os.environ.pop("HF_HUB_CACHE", None)
os.environ.pop("HF_DATASETS_CACHE", None)


def session_dir(tmp_path_factory, name: str) -> Path:
    """A directory shared by the whole session: under pytest-xdist, by every worker (they share the
    parent of their base temp directories), so what one worker builds the others reuse."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(autouse=True, scope="session")
def session_environment_recorded():
    """The environment warm processes' servers start with (helpers.SESSION_ENV), taken before any
    test module could change it."""
    import helpers

    helpers.SESSION_ENV.update(os.environ)


@pytest.fixture(autouse=True, scope="module")
def environment_as_found(tiny_cache):
    """Each test module leaves `os.environ` as it found it: vLLM writes into the environment of the
    process that imports it or builds an engine (LOCAL_WORLD_SIZE, LD_PRELOAD, ...), and the runs
    and subprocesses of later modules would inherit it (a submitit task refuses to start with
    LOCAL_WORLD_SIZE set; a warm run whose environment differs from the fork server's runs cold).
    Taken after `tiny_cache`, whose RLTRAIN_CACHE is the session's."""
    from rltrain.runtime.process_state import restore_environment

    snapshot = dict(os.environ)
    yield
    restore_environment(snapshot)


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


def pytest_configure(config):
    config.stash[SUITE_STARTED] = time.monotonic()


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """`make test` (which asks for --durations) ends with the suite's wall time beside this machine's
    speed (tests/machine_speed.py), so a slower machine's run can be compared with the reference
    machine's in docs/testing.md. Printed by pytest's own process, after the workers finished."""
    if config.getoption("durations", None) is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from machine_speed import probe_tokens_per_s

    minutes, seconds = divmod(round(time.monotonic() - config.stash[SUITE_STARTED]), 60)
    terminalreporter.write_sep("=", f"rltrain suite: {minutes}:{seconds:02d} wall, machine speed {probe_tokens_per_s():.0f} "
                               "tokens/s (tests/machine_speed.py; docs/testing.md has the reference machine's)")


def pytest_sessionfinish(session, exitstatus):
    """The test run's Hugging Face caches go with it (removed by the process that made them)."""
    if os.environ.get("RLTRAIN_TEST_HF_HOME_OWNER") == str(os.getpid()):
        shutil.rmtree(HF_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def rollout_servers(tiny_cache, tmp_path_factory):
    """Two vLLM API servers (`rollout=server`) on the tiny model the runs of tests/cli.py's
    SMALL_MODEL use, started once per session (each takes tens of seconds on a CPU): a dict with
    the model directory, the rollout config and the `SpawnedServer`s (a test that restarts one
    puts the new one in its place, so the session stops what runs)."""
    from cli import SMALL_MODEL

    from rltrain.models.model_dir import resolve_model_dir
    from rltrain.rollout.server.process import SpawnedServer, stop_servers
    from rltrain.serve import compose_run_config

    cfg = compose_run_config(["model=tiny", *SMALL_MODEL, "rollout=server", "rollout.servers.spawn=1", "rollout.timeout_s=60"])
    model_dir = resolve_model_dir(cfg.model, cfg.data, cfg.trainer)
    logs = session_dir(tmp_path_factory, "rollout_servers")
    servers = [SpawnedServer(cfg.rollout, model_dir, "float32", False, logs / f"server-{i}.log") for i in range(2)]
    try:
        for server in servers:
            server.wait_ready(cfg.rollout.servers.start_timeout_s)
        yield {"model_dir": model_dir, "cfg": cfg.rollout, "servers": servers, "logs": logs}
    finally:
        stop_servers(servers)


@pytest.fixture(scope="session")
def tiny_vl_dir(tiny_cache) -> Path:
    """The tiny vision-language model (model=tiny_vl, seed 0), built once for the session."""
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny_vl import build_tiny_vl_model_dir

    cfg = ModelConfig(arch="qwen2_vl", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                      intermediate_size=128, max_position_embeddings=1024)
    return build_tiny_vl_model_dir(cfg, seed=0)


@pytest.fixture(scope="session")
def image_data(tmp_path_factory) -> Path:
    """The image dataset of the vision-language end-to-end tests (tests/vision_data.py), written
    once for the session (every pytest-xdist worker reads the same files)."""
    from vision_data import write_image_data

    return write_image_data(session_dir(tmp_path_factory, "vision_data"))
