"""Starting vLLM's own OpenAI-compatible API server for `rollout=server`: its command line (what
the trainer needs in it: token-in/token-out generation, the dev-mode RPC the weight push rides on,
our worker extension, the trainer's raw log-probabilities), and a spawned server's lifetime (it
dies with the trainer: rltrain/rollout/server/guard.py). docs/rollout-servers.md.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from rltrain.config.group_options import ServerRolloutConfig
from rltrain.rollout.kv_budget import kv_cache_bytes
from rltrain.rollout.server.client import ServerDown, ServerRefused, is_up, server_identity
from rltrain.rollout.server.extension import SERVER_ID_ENV
from rltrain.runtime.threads import usable_cores

EXTENSION = "rltrain.rollout.server.extension.WeightPushExtension"
# torch.distributed / elastic variables a server must not inherit from a trainer rank.
_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT")


def server_command(cfg: ServerRolloutConfig, model_dir: str | Path, dtype: str, host: str, port: int, cuda: bool) -> list[str]:
    """vLLM's own API server (what `vllm serve` runs) for one server of this run; by module, so it
    runs in this interpreter's environment whatever the PATH holds."""
    command = [
        sys.executable, "-W", "ignore::DeprecationWarning", "-m", "rltrain.rollout.server.api_server",  # vLLM's, rltrain first
        "--model", os.fspath(model_dir), "--dtype", dtype, "--seed", str(cfg.seed),
        "--host", host, "--port", str(port),
        "--logprobs-mode", "raw_logprobs",  # the trainer's log-softmax, for the parity check
        "--enable-prefix-caching", "--enable-scale-out",  # /inference/v1/generate: token ids in and out
        "--worker-extension-cls", EXTENSION,
        "--max-num-seqs", str(cfg.max_num_seqs),
        "--disable-uvicorn-access-log", "--disable-log-stats",
    ]
    if cfg.max_model_len is not None:
        command += ["--max-model-len", str(cfg.max_model_len)]
    if cuda:
        command += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    else:
        # The worker inside the engine process (with VLLM_ENABLE_V1_MULTIPROCESSING=0, server_env):
        # one interpreter fewer to start, and no worker busy-polling its queue beside the trainer.
        kv_bytes = kv_cache_bytes(model_dir, cfg.kv_cache_gib, cfg.max_num_seqs, cfg.max_model_len, dtype)
        command += ["--enforce-eager", "--kv-cache-memory-bytes", str(kv_bytes),
                    "--distributed-executor-backend", "uni"]
        # A prompt prefilled in chunks has its seeded generator rewound, which a CPU generator cannot
        # do: the engine dies. Whole prefills only (rltrain/rollout/vllm.py's prefill_waves is the
        # in-process engine's way to the same end); a step then takes up to max_model_len tokens.
        command += ["--no-enable-chunked-prefill"]
    return command


def server_env(cfg: ServerRolloutConfig, cuda: bool, server_id: str) -> dict[str, str]:
    """The server's environment: dev mode (`/collective_rpc`), rltrain importable, no trainer rank,
    and `server_id`, the identity its worker extension reports."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV and not k.startswith("TORCHELASTIC_")}
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env[SERVER_ID_ENV] = server_id
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # The in-process engine's setting does not pass on. On a CPU "0" keeps the uni executor that
    # server_command asks for (vLLM's CPU build overrides it otherwise); on CUDA vLLM's default.
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if not cuda:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the byte budget on the command line applies
        # The engine's OpenMP threads leave one core to the API server's own process (vLLM's
        # multiprocess executor reserves one for its scheduler the same way): an engine on every
        # core stalls whenever the API server parses a request, and a step waits for its slowest thread.
        env["OMP_NUM_THREADS"] = str(cfg.num_threads or max(1, usable_cores() - 1))
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_problem(host: str, port: int) -> str | None:
    """Why a server cannot listen on `port` of `host` ("taken": something holds it, on that address
    or on every interface), or None: the bind a server makes goes through. With SO_REUSEADDR, as
    vLLM's server binds: a port left in TIME_WAIT only is free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return "taken" if exc.errno == errno.EADDRINUSE else str(exc)
    return None


class SpawnedServer:
    """One API server this trainer started; `stop()` ends it and its engine process."""

    def __init__(
        self, cfg: ServerRolloutConfig, model_dir: str | Path, dtype: str, cuda: bool, log_path: Path, port: int | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        """`extra_args`: more `vllm serve` flags (the judge's sleep mode, rltrain/rewards/judge/served.py)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server_id = uuid.uuid4().hex
        self.log_path = log_path
        with open(log_path, "ab") as log:
            # Through the guard (rltrain/rollout/server/guard.py), in a session of its own: the
            # server and vLLM's engine processes go when the trainer goes, however it goes.
            guard = [sys.executable, "-m", "rltrain.rollout.server.guard", str(os.getpid())]
            self.proc = subprocess.Popen(
                guard + server_command(cfg, model_dir, dtype, "127.0.0.1", self.port, cuda) + list(extra_args),
                env=server_env(cfg, cuda, self.server_id), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the spawned vLLM server {self.url} exited with code {self.proc.returncode} while starting; "
                    f"its log: {self.log_path}\n{_tail(self.log_path)}"
                )
            if is_up(self.url) and is_ours(self.url, self.server_id):
                return
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(
            f"the spawned vLLM server {self.url} did not answer /health within rollout.servers.start_timeout_s="
            f"{timeout_s:g}s (stopped); its log: {self.log_path}\n{_tail(self.log_path)}"
        )

    def stop(self) -> None:
        stop_servers([self])

    def _terminate(self) -> None:
        """SIGTERM to the guard alone: stopping the server, then what is left of its session, is the
        guard's job, in that order (`_reap` kills whatever a dead guard left)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)

    def _reap(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def is_ours(url: str, server_id: str) -> bool:
    """Whether the server answering at `url` is the one started with `server_id` (not another that
    holds the port)."""
    try:
        return server_identity(url, 10.0) == server_id
    except (ServerDown, ServerRefused, IndexError, TypeError):
        return False


def stop_servers(servers: list[SpawnedServer]) -> None:
    """SIGTERM to each server's guard at once (each stops its server and kills what is left of its
    session), then wait for each, and SIGKILL what is left of each session."""
    for server in servers:
        server._terminate()
    for server in servers:
        server._reap()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
