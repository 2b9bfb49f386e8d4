"""The rank server of warm CLI runs: a child of the tests' fork server (`run`, started by
tests/cli.py `rank_server`), so it holds the libraries every rank imports (helpers.PRELOAD).

It forks a process for each stand-in that connects (tests/stand_in.py has the protocol and the
stand-in's side; `{"count": true}` asks how many it forked): a rank of `python -m rltrain.worker`,
a separate rollout process or a launcher-started `python -m rltrain`, running the stand-in's command
with its environment, cwd, sys.path and descriptors, in a session of its own; SIGKILLed, with its
process group, when its stand-in goes away or this server dies. A process that builds a vLLM engine
is forked by a child of this server that has imported vLLM too (`vllm_server`). docs/testing.md,
"Warm ranks" and the vLLM server after it."""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import warnings
from pathlib import Path

from stand_in import die_with

# What a rank's environment may hold that the server's does not, besides helpers.WARM_ENV_PREFIXES
# (read only by rltrain, by libraries not preloaded, or on use): what the elastic agent sets for
# each rank (torch reads none of them on import). Any other difference starts the rank cold.
AGENT_ENV_PREFIXES = ("TORCHELASTIC_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCH_NCCL_ASYNC_ERROR_HANDLING")
SERVER_ENV: dict[str, str] = {}  # the server's environment (`run`)
# torch's thread count, which torchrun (more than one rank per node) and a spawned vLLM server set:
# it may differ, as a count up to the server's own, and the forked process applies it (`apply_threads`).
THREADS_ENV = "OMP_NUM_THREADS"
SERVER_THREADS: list[int] = []  # torch's thread count in the server (`run`)

# What the vLLM server imports: what building an engine on the CPU imports (vllm's own modules,
# and through them OpenCV, gRPC and OpenTelemetry), read once instead of once per engine.
VLLM_MODULES = ["vllm", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core",
                "vllm.v1.executor.uniproc_executor", "vllm.v1.core.sched.scheduler", "vllm.v1.worker.cpu_worker",
                "vllm.v1.worker.cpu_model_runner", "vllm.v1.attention.backends.cpu_attn", "vllm.v1.sample.sampler",
                "vllm.model_executor.model_loader.default_loader", "vllm.model_executor.models.qwen2",
                "vllm.model_executor.models.llama", "vllm.platforms.cpu"]
# What vLLM reads on import that rltrain sets before importing it (rltrain.rollout.build_rollout):
# the level its loggers are configured with. A process whose environment differs from the server's
# in anything else vLLM may read on import (any other VLLM_ variable, inductor's cache directory) is
# forked from the rank server instead, and imports vLLM itself.
VLLM_IMPORT_ENV = {"VLLM_LOGGING_LEVEL": "ERROR"}
# Read by vLLM only when it builds an engine (rltrain.rollout.vllm_args.set_vllm_env sets them).
VLLM_READ_ON_USE = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")
VLLM_WRITTEN: list[dict[str, str]] = []  # what importing vLLM wrote into the environment, once known
VLLM_SERVER: list[socket.socket] = []  # the rank server's end of its hand-off socket, once started


class StandIn:
    """One connection: the request being read, then the rank it started."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buffer, self.fds = conn, b"", []
        self.rank_pid: int | None = None
        self.pidfd: int | None = None


def read_request(client: StandIn) -> dict | None:
    """The request once its line is complete (None until then); raises EOFError on a closed peer."""
    data, fds, _flags, _addr = socket.recv_fds(client.conn, 1 << 20, 8)
    if not data:
        raise EOFError
    client.fds += fds
    client.buffer += data
    if b"\n" not in client.buffer:
        return None
    return json.loads(client.buffer.split(b"\n", 1)[0])


def become_rank(request: dict, fds: list[int], listener: socket.socket, conns: list[socket.socket]) -> None:
    """In the forked child: turn into the process the stand-in stands for and exit as `python *argv`
    would. Where the command names the process it dies with (`parent_named_in`), that is now this
    process's parent, the server."""
    from helpers import main_of, run_as_interpreter

    listener.close()
    for c in conns:
        c.close()
    os.setsid()
    die_with(int(request["server"]))
    # Out of the way first: a received descriptor may hold a number another one is going to.
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in fds]
    for fd in fds:
        os.close(fd)
    for target, fd in zip(request["fds"], moved, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the interpreter's own streams
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    argv, env = list(request["argv"]), dict(request["env"])
    if request.get("parent_named_in"):
        where, key = request["parent_named_in"]
        (argv if where == "argv" else env)[key] = str(request["server"])
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    sys.path[:] = request["sys_path"]
    apply_threads(env)
    run_as_interpreter(main_of(argv))


def threads_applicable(env: dict[str, str]) -> bool:
    """Whether a process with `env` may be forked although its OMP_NUM_THREADS differs from the
    server's: it names a count no larger than the server's own. A fresh torch takes such a count as
    it is, and caps a larger one (MKL, with MKL_DYNAMIC's default, at the physical cores), which
    the server does not redo: unset, larger or not a number, the process starts cold."""
    value = env.get(THREADS_ENV, "")
    return value.isdigit() and 0 < int(value) <= SERVER_THREADS[0]


def apply_threads(env: dict[str, str]) -> None:
    """In the forked process: the thread count a fresh interpreter would take from OMP_NUM_THREADS.
    OpenMP read the variable when the server loaded it; torch.set_num_threads sets OpenMP's and
    MKL's counts, and ATen applies it to every thread that later runs a parallel region, as a fresh
    torch does with the variable (docs/testing.md, "Warm ranks")."""
    if env.get(THREADS_ENV) != SERVER_ENV.get(THREADS_ENV):
        import torch

        torch.set_num_threads(int(env[THREADS_ENV]))


def send(conn: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):
        conn.sendall((json.dumps(message) + "\n").encode())


def serve(listener: socket.socket, handoffs: bool = False) -> None:
    """Serve the stand-ins connecting to `listener`, or (`handoffs`, the vLLM server) those the rank
    server hands over through it: a stand-in's connection, its descriptors and its request."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "handoff" if handoffs else None)
    clients: dict[int, StandIn] = {}  # by connection fd
    while True:
        for key, _ in selector.select():
            if key.data == "handoff":
                take_handoff(listener, selector, clients)
                continue
            if key.data is None:
                conn, _ = listener.accept()
                client = StandIn(conn)
                clients[conn.fileno()] = client
                selector.register(conn, selectors.EVENT_READ, ("conn", client))
                continue
            kind, client = key.data
            if kind == "pidfd":
                finish(client, selector, clients)
            elif client.rank_pid is None:
                try:
                    request = read_request(client)
                except (EOFError, OSError):
                    close(client, selector, clients)
                    continue
                if request is not None:
                    start(client, request, listener, selector, clients)
            else:  # the stand-in went away (its only message was the request): its rank goes too
                with contextlib.suppress(OSError):
                    if client.conn.recv(1):
                        continue
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(client.rank_pid, signal.SIGKILL)
                selector.unregister(client.conn)
                client.conn.close()


FORKED = [0, 0]  # processes forked so far, of them by the vLLM server ({"count": true}; tests/e2e/test_warm_runs.py)


def start(client: StandIn, request: dict, listener: socket.socket, selector, clients: dict[int, StandIn],
          checked: bool = False) -> None:
    if request.get("count"):
        send(client.conn, {"forked": FORKED[0], "vllm": FORKED[1]})
        close(client, selector, clients)
        return
    from helpers import WARM_ENV_PREFIXES

    allowed = WARM_ENV_PREFIXES + AGENT_ENV_PREFIXES
    differing = sorted(k for k in set(request["env"]) | set(SERVER_ENV)
                       if request["env"].get(k) != SERVER_ENV.get(k) and not k.startswith(allowed)
                       and not (k == THREADS_ENV and threads_applicable(request["env"])))
    if differing and not checked:  # a preloaded library may have read one of them: the rank starts cold
        send(client.conn, {"cold": differing})
        close(client, selector, clients)
        return
    if not checked and (request.get("vllm") or builds_vllm_engine(request)):
        if vllm_server_takes(request["env"]) and hand_over(client, request):
            close(client, selector, clients)
            return
        if request.get("vllm"):  # a warm run's own request (tests/cli.py VllmServerChild): it forks elsewhere
            send(client.conn, {"declined": "no vLLM server for this environment"})
            close(client, selector, clients)
            return
    request["server"] = os.getpid()
    pid = os.fork()
    if pid == 0:
        become_rank(request, client.fds, listener, [c.conn for c in clients.values()])
    for fd in client.fds:
        os.close(fd)
    client.fds = []
    client.rank_pid = pid
    FORKED[0] += 1
    client.pidfd = os.pidfd_open(pid)
    selector.register(client.pidfd, selectors.EVENT_READ, ("pidfd", client))
    send(client.conn, {"pid": pid})


def finish(client: StandIn, selector, clients: dict[int, StandIn]) -> None:
    assert client.rank_pid is not None and client.pidfd is not None
    _, status = os.waitpid(client.rank_pid, 0)
    selector.unregister(client.pidfd)
    os.close(client.pidfd)
    if client.conn.fileno() >= 0:
        send(client.conn, {"exit": os.waitstatus_to_exitcode(status)})
    close(client, selector, clients)


def close(client: StandIn, selector, clients: dict[int, StandIn]) -> None:
    fileno = client.conn.fileno()
    if fileno >= 0:
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(client.conn)
        client.conn.close()
        clients.pop(fileno, None)
    for fd in client.fds:
        os.close(fd)
    client.fds = []


def builds_vllm_engine(request: dict) -> bool:
    """Whether the process builds a vLLM engine in-process: a separate rollout process, or a rank
    of an RL run whose rollout is vLLM in the trainer's process (its run's config.yaml says)."""
    module, args = request["argv"][1], request["argv"][2:]
    if module == "rltrain.rollout.separate_child":
        return True
    if module != "rltrain.worker":
        return False
    import yaml

    try:
        cfg = yaml.safe_load((Path(request["cwd"]) / args[0] / "config.yaml").read_text())
        rollout, algo = cfg["rollout"], cfg["algo"]["name"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return False
    return algo in ("grpo", "ppo") and rollout.get("name") == "vllm" and rollout.get("process") == "colocated"


def vllm_server_takes(env: dict[str, str]) -> bool:
    """Whether a process with this environment behaves as in a fresh interpreter when forked from the
    vLLM server: what vLLM reads on import is what the server imported it with (VLLM_IMPORT_ENV,
    else the server's), and what the import writes is as the server had it or as the import left it
    (a process started by one that imported vLLM)."""
    written = vllm_server_ready()
    if written is None:
        return False
    for key in set(env) | set(SERVER_ENV) | set(VLLM_IMPORT_ENV):
        value = env.get(key)
        if key in VLLM_IMPORT_ENV:
            ok = value in (None, VLLM_IMPORT_ENV[key])
        elif key in written:
            ok = value in (SERVER_ENV.get(key), written[key])
        elif key == "TORCHINDUCTOR_CACHE_DIR":  # inductor, imported first, writes its default there
            ok = value in (None, SERVER_ENV.get(key))
        else:
            ok = value == SERVER_ENV.get(key) or not key.startswith(("VLLM_", "TORCHINDUCTOR_")) or key in VLLM_READ_ON_USE
        if not ok:
            return False
    return True


def hand_over(client: StandIn, request: dict) -> bool:
    """Pass the stand-in's connection, descriptors and request to the vLLM server; False when it is gone."""
    try:
        socket.send_fds(VLLM_SERVER[0], [json.dumps(request).encode()], [client.conn.fileno(), *client.fds])
    except OSError:
        return False
    FORKED[0] += 1
    FORKED[1] += 1
    return True


def vllm_server_ready() -> dict[str, str] | None:
    """What importing vLLM wrote into the vLLM server's environment, once it has (waiting for its
    imports the first time); None when there is no vLLM server."""
    if VLLM_SERVER and not VLLM_WRITTEN:
        message = VLLM_SERVER[0].recv(1 << 20)
        if not message:  # it failed to import vLLM and said why on stderr
            VLLM_SERVER.clear()
            return None
        VLLM_WRITTEN.append(json.loads(message))
    return VLLM_WRITTEN[0] if VLLM_SERVER else None


def vllm_server(handoff: socket.socket, parent: int) -> None:
    """The vLLM server's process (forked by `start_vllm_server`): import VLLM_MODULES as rltrain would
    (VLLM_IMPORT_ENV; rltrain.runtime.library_noise.quiet_vllm_import), tell the rank server what
    the import wrote into the environment, put the environment back, freeze the heap, and serve."""
    import gc
    import logging

    die_with(parent)
    os.environ.update(VLLM_IMPORT_ENV)
    logging.getLogger("vllm").setLevel(VLLM_IMPORT_ENV["VLLM_LOGGING_LEVEL"])
    try:
        with warnings.catch_warnings():  # quiet_vllm_import's filter; the rank adds it again
            warnings.simplefilter("ignore", FutureWarning)
            for module in VLLM_MODULES:
                importlib.import_module(module)
            from vllm.platforms import current_platform

            current_platform.device_type  # noqa: B018 - resolves the platform, as building an engine does
            # What the first engine of a process does (vLLM's kernel overrides scan every module): its
            # forks then start as a process's later engines do (rltrain registers them once).
            current_platform.register_triton_kernel_overrides()
    except Exception as exc:  # noqa: BLE001 - the rank server then forks every process itself
        sys.stderr.write(f"tests/rank_server.py: no vLLM server, vLLM failed to import: {exc!r}\n")
        os._exit(1)
    written = {k: v for k, v in os.environ.items() if SERVER_ENV.get(k) != v and k not in VLLM_IMPORT_ENV}
    VLLM_WRITTEN.append(written)
    os.environ.clear()
    os.environ.update(SERVER_ENV)
    gc.collect()
    gc.freeze()
    handoff.send(json.dumps(written).encode())
    serve(handoff, handoffs=True)


def take_handoff(handoff: socket.socket, selector, clients: dict[int, StandIn]) -> None:
    """In the vLLM server: a stand-in the rank server handed over; fork its process. Its environment
    is the stand-in's, as a fresh process's is until it imports vLLM (a 1-rank run starts the SFT
    start's run before that): what the import writes is not added."""
    data, fds, _flags, _addr = socket.recv_fds(handoff, 1 << 22, 64)
    if not data:  # the rank server is gone
        os._exit(0)
    client = StandIn(socket.socket(fileno=fds[0]))
    client.fds = fds[1:]
    clients[client.conn.fileno()] = client
    selector.register(client.conn, selectors.EVENT_READ, ("conn", client))
    start(client, json.loads(data), handoff, selector, clients, checked=True)


def start_vllm_server(listener: socket.socket) -> None:
    """Fork the vLLM server (`vllm_server`); this server keeps one end of a socket to it."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        ours.close()
        listener.close()
        vllm_server(theirs, parent)
        os._exit(0)
    theirs.close()
    VLLM_SERVER.append(ours)


def run(path: str) -> None:
    """The server's process: a child of the tests' fork server (helpers.rank_context), which has
    imported PRELOAD and holds the session's environment; it ends with that fork server."""
    import torch

    SERVER_ENV.clear()
    SERVER_ENV.update(os.environ)
    SERVER_THREADS[:] = [torch.get_num_threads()]
    die_with(os.getppid())
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    start_vllm_server(listener)
    serve(listener)
