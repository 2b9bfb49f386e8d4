"""Run a function on N local ranks over gloo, with a short process-group timeout.

A hang in the code under test becomes a failure: every collective times out after
`pg_timeout_s`, and the whole group is killed after `timeout_s`.

Ranks are fresh processes forked from a fork server that has imported torch and transformers once
per test process (docs/testing.md, "Start-up"): each test still gets new processes and a new
process group, without paying the imports again. The parent's environment, working directory and
sys.path travel with each call, since the server was started before the test set them. On a CUDA
machine ranks are spawned instead: a fork after anything initialised CUDA cannot use the GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the fork server imports before forking ranks and warm CLI runs (tests/cli.py run_warm): the
# cost every process would otherwise pay. Only libraries, never rltrain, vllm or megatron-core: their
# modules are imported in each child, after that child's environment is in place (vllm's engine
# modules excepted for the processes that build an engine: tests/rank_server.py `vllm_server`). The second list is
# what those import from other libraries (scipy, matplotlib for plots.png, torch's compiler and
# distributed modules, vLLM's server-side dependencies): seconds per rank, read once here. None of
# them reads an RLTRAIN_/VLLM_/WANDB_ variable on import (a warm run may set those differently) or
# leaves a Python thread running; OpenCV and gRPC are left out (a native thread, fork handlers).
PRELOAD = ["torch", "torch.distributed", "torch._inductor.config", "torchvision_importable", "transformers", "safetensors.torch", "datasets",
           "hydra", "omegaconf"]
PRELOAD += [
    "scipy.stats", "scipy.optimize", "scipy.sparse", "scipy.signal", "scipy.integrate", "scipy.interpolate", "scipy.spatial",
    "scipy.ndimage", "networkx", "sympy", "matplotlib.pyplot", "matplotlib.backends.backend_agg", "accelerate",
    "torch._dynamo", "torch._inductor.compile_fx", "torch.distributed.fsdp", "torch.distributed.checkpoint",
    "torch.distributed.tensor", "torch.export", "transformers.generation", "transformers.models.qwen2.modeling_qwen2",
    "openai", "fastapi", "aiohttp", "compressed_tensors", "xgrammar", "opentelemetry.trace", "zmq", "msgspec",
    "prometheus_client", "cbor2", "tiktoken", "partial_json_parser", "llguidance", "openai_harmony", "einops", "psutil",
    "cpuinfo", "uvloop", "requests", "pybase64",
]
# Then one tiny compile (tests/compiler_warmed.py), and last the heap preloaded above is frozen
# (tests/heap_frozen.py).
PRELOAD += ["compiler_warmed", "heap_frozen"]

# Environment variables a warm run (tests/cli.py) or a forked rank (tests/rank_server.py) may set
# differently from its server's: each is read only by rltrain or by a library the servers have not
# imported (PRELOAD above), so the run sees it as a fresh interpreter would; PYTHONPATH too, since
# the child's sys.path is the one a fresh interpreter would build from it (tests/cli.py
# _cold_sys_path); the terminal size (COLUMNS, LINES), which readline writes into the C environment
# of an interactive test process (a server started from it inherits them) and which is read when
# output is laid out, never on import; and inductor's cache directory, which inductor looks up each
# time it reads or writes its cache (`cache_dir()`), so a run given its own compiles into it as a
# fresh interpreter would; and megatron-core's choice of attention backend (NVTE_*), which it writes
# into a rank's environment when it builds a model (a rollout process the rank starts inherits it)
# and which only megatron-core, on use, and Transformer Engine read; and trackio's database
# directory (TRACKIO_DIR), read when trackio is imported, which only a run naming the tracker does.
# Any other difference (HF_*, OMP_*, other TORCHINDUCTOR_* settings, which inductor reads on
# import...) runs cold.
WARM_ENV_PREFIXES = ("RLTRAIN_", "PYTEST_", "WANDB_", "VLLM_", "PYTHONPATH", "COLUMNS", "LINES", "TORCHINDUCTOR_CACHE_DIR",
                     "NVTE_", "TRACKIO_DIR")


def cuda_machine() -> bool:
    """Whether this machine has a CUDA device: the GPU suite then starts every process fresh (spawn,
    cold CLI runs), since a process forked from one that initialised CUDA cannot use the GPU, and
    its start-up is not what bounds that suite."""
    import torch

    return torch.cuda.is_available()


# The environment the test process began with (tests/conftest.py records it once it has set its
# own variables). The servers of warm processes (the fork server below, the rank server of
# tests/cli.py) start with it whenever they are first needed: a server started inside a module that
# had changed os.environ (vLLM writes LOCAL_WORLD_SIZE, LD_PRELOAD, ... when it builds an engine in
# the test process) would hold that environment, and every later warm run of the process would
# differ from it and run cold.
SESSION_ENV: dict[str, str] = {}


@contextlib.contextmanager
def session_environment():
    """os.environ as the test process began (SESSION_ENV; unchanged outside pytest) for the block."""
    from rltrain.runtime.process_state import restore_environment

    saved = dict(os.environ)
    if SESSION_ENV:
        restore_environment(SESSION_ENV)
    try:
        yield
    finally:
        restore_environment(saved)


def rank_context():
    """The multiprocessing context ranks start from (forkserver, with PRELOAD imported once, started
    with SESSION_ENV; spawn on a CUDA machine)."""
    if cuda_machine():
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with session_environment():
        # Python 3.11's fork server drops the sys.path it is handed and skips a preload it cannot
        # import without a word: the test modules among PRELOAD are found through PYTHONPATH. Its
        # children take the environment and sys.path of the process asking (`adopt`).
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")]))
        forkserver.ensure_running()
    return ctx


def adopt(env: dict, cwd: str, sys_path: list) -> None:
    """In a child of the fork server: take on the environment, working directory and sys.path of the
    process that asked for it (the server was started before tests set theirs)."""
    import sys

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = sys_path


def _entry(rank: int, fn: Callable, nproc: int, port: int, pg_timeout_s: float, result_q, collected, args: tuple,
           parent: tuple[dict, str, list]) -> None:

    import torch
    import torch.distributed as dist

    adopt(*parent)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=nproc, timeout=datetime.timedelta(seconds=pg_timeout_s)
        )
        out = fn(rank, nproc, *args)
        result_q.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        result_q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Tensors in the result are shared through this process: stay alive until the parent has them.
        collected.wait(timeout=60)


# What rank 0's rendezvous store says when another process took the free port between `free_port`
# and its bind: the group never formed and `fn` never ran, so the run is repeated on a new port.
PORT_TAKEN = "EADDRINUSE"


def portable(obj):
    """A rank's result with tensors as numpy arrays: torch's queue pickling shares tensor storage by
    file descriptor, which breaks when the rank exits before the parent unpickles; numpy pickles by value."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(portable(v) for v in obj)
    return obj


def ragged_micro_batches(rank: int, vocab: int) -> list:
    """Two micro-batches of ragged (prompt, completion) rows for each of 2 ranks, the same count on
    each (an expert-parallel all-to-all is collective), random ids below `vocab` seeded by the rank."""
    import torch

    from rltrain.data.batch import SequenceBatch

    g = torch.Generator().manual_seed(10 + rank)
    shapes = [[(3, 5), (6, 2)], [(4, 7)]] if rank == 0 else [[(2, 6)], [(5, 3), (7, 1)]]
    return [
        SequenceBatch.from_lists(
            [torch.randint(0, vocab, (p,), generator=g).tolist() for p, _ in mb],
            [torch.randint(0, vocab, (c,), generator=g).tolist() for _, c in mb],
        )
        for mb in shapes
    ]


def run_ranks(fn: Callable, *args: Any, nproc: int = 2, timeout_s: float = 120, pg_timeout_s: float = 20) -> list:
    """Run `fn(rank, world_size, *args)` on `nproc` gloo ranks; return each rank's result.

    `fn` must be importable (a module-level function). Results cross by a multiprocessing queue,
    so keep them small (floats, lists, tensors). Raises if any rank raised or the group timed out.
    A rendezvous port taken by another process (`PORT_TAKEN`) is retried once on a new port.
    """
    try:
        return _run_ranks_once(fn, args, nproc, timeout_s, pg_timeout_s)
    except AssertionError as exc:
        if PORT_TAKEN not in str(exc):
            raise
    return _run_ranks_once(fn, args, nproc, timeout_s, pg_timeout_s)


def _run_ranks_once(fn: Callable, args: tuple, nproc: int, timeout_s: float, pg_timeout_s: float) -> list:
    import sys

    ctx = rank_context()
    q = ctx.Queue()
    collected = ctx.Event()
    port = free_port()
    parent = (dict(os.environ), os.getcwd(), list(sys.path))
    procs = [
        ctx.Process(target=_entry, args=(r, fn, nproc, port, pg_timeout_s, q, collected, args, parent), daemon=True)
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    failed: set[int] = set()
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout_s
    while len(results) + len(errors) < nproc:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, status, payload = q.get(timeout=min(remaining, 1.0))
        except queue_mod.Empty:
            # Every rank has reported or died (a rank killed by an abort never reports): stop waiting.
            reported = set(results) | failed
            if all(r in reported or not p.is_alive() for r, p in enumerate(procs)) and q.empty():
                break
            continue
        if status == "ok":
            results[rank] = payload
        else:
            errors.append(f"rank {rank}:\n{payload}")
            failed.add(rank)
    collected.set()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("a rank failed:\n" + "\n".join(errors))
    if len(results) < nproc:
        raise TimeoutError(f"only ranks {sorted(results)} of {nproc} finished within {timeout_s}s (hang?)")
    return [results[r] for r in range(nproc)]


def compose_config(*overrides: str):
    """The composed run config for `overrides`, exactly as `python -m rltrain` composes it (no run)."""
    from hydra import compose, initialize_config_dir

    from rltrain.__main__ import CONF_DIR
    from rltrain.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=list(overrides))


@contextlib.contextmanager
def mounted_tmpfs(size: str):
    """A fresh tmpfs of `size` (e.g. "64m"), unmounted afterwards; pytest.skip where mounting is
    refused (not root)."""
    import pathlib
    import subprocess
    import tempfile

    import pytest

    where = pathlib.Path(tempfile.mkdtemp(prefix="rlshm-"))
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if proc.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)
        where.rmdir()


def direct_completion_logps(model_dir, prompts: list[list[int]], completions: list[list[int]]):
    """Completion-token log-probabilities from a plain transformers model, one unpadded sequence at
    a time: the reference that engine-computed log-probabilities are compared with."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions):
            ids_T = torch.tensor([prompt + completion])
            logps_TV = torch.log_softmax(model(ids_T).logits[0].float(), dim=-1)
            positions = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
            out.append(logps_TV[positions, ids_T[0, len(prompt) :]])
    return torch.cat(out)


def main_of(argv: list[str]) -> Callable[[], object]:
    """What `python *argv` runs as `__main__`, with `sys.argv` set as it would set it."""
    import runpy

    if argv[0] == "-m":
        sys.argv = ["-m", *argv[2:]]  # run_module puts the module's file first
        return lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        return lambda: exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
    sys.argv = list(argv)
    return lambda: runpy.run_path(argv[0], run_name="__main__")


def run_as_interpreter(main) -> None:
    """Call `main()` (a module run as `__main__`) and end this forked process as `python` would end:
    the exit status from SystemExit (a non-int code printed, status 1), an uncaught exception's
    traceback and status 1, non-daemon threads joined, atexit handlers run, streams flushed."""
    import atexit
    import contextlib
    import sys
    import threading
    import traceback

    code = 0
    try:
        main()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter joins non-daemon threads first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.flush()
    os._exit(code)
