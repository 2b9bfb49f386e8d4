"""Run `python -m rltrain ...` as a user would, with a bounded time; and the shared runs: one run
per configuration per test session, read by every test that inspects it (docs/testing.md)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import stand_in
from helpers import WARM_ENV_PREFIXES

ROOT = Path(__file__).resolve().parents[1]

# A smaller tiny model, for runs whose subject is not the model (launching, failures).
SMALL_MODEL = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=128",
]

# model=tiny: RL tests start from the plain tiny model, not from algo=grpo's default SFT start
# (model=tiny_sft, built once per spec: tests/e2e/test_tiny_sft.py covers it).
QUICK = [
    "model=tiny",
    "logger.wandb.mode=disabled",
    "trainer.eval_every=0",
    "trainer.save_every=0",
    "trainer.progress=lines",
    "logger.plot=false",  # the run's plots.png: tests/e2e/test_trackers_and_sampled_eval.py, test_sweep_launchers.py
]


def rltrain(*args: str, run_dir: Path | None = None, timeout: float = 300, env: dict | None = None, check: bool = True,
            warm: bool = True):
    """`python -m rltrain *args` (cwd: the project root), its output captured.

    With `warm` (the default) the command runs in a process forked from the tests' warm fork server
    (`run_warm`): the same `python -m rltrain` code path, minus the interpreter start and the imports
    that fork server already made. A test that reads the whole console (import-time output
    included), or a command whose environment differs where a preloaded library reads it, runs cold:
    a fresh interpreter, as a user's shell starts it (docs/testing.md, "Warm CLI runs"). Its ranks
    are forked from the rank server ("Warm ranks")."""
    if run_dir is not None:
        args = (*args, f"hydra.run.dir={run_dir}")
    proc = python("-m", "rltrain", *args, timeout=timeout, env=env, warm=warm)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}")
    return proc


def python(*argv: str, timeout: float = 300, env: dict | None = None, warm: bool = True) -> subprocess.CompletedProcess:
    """`python *argv` (`-m module ...`, `-c code ...` or `script.py ...`; cwd: the project root), its
    output captured: in a child of the warm fork server unless `warm` is False, its environment
    needs a fresh interpreter or the machine has CUDA (`run_warm`), as `rltrain(...)` runs."""
    cmd = [sys.executable, *argv]
    full_env = dict(os.environ, **(env or {}))
    proc = run_warm(cmd, full_env, timeout) if warm else None
    if proc is None:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise CommandTimedOut(cmd, timeout, _decoded(exc.output), _decoded(exc.stderr)) from None
    return proc


# Set by a preloaded library on import (inductor writes its default cache dir back into the
# environment): a command that does not set it gets the same value in a fresh interpreter.
SET_BY_PRELOAD = ("TORCHINDUCTOR_CACHE_DIR",)
WARM_REFUSED = 86  # the warm child's exit status when the environment needs a fresh interpreter
WARM_REFUSED_MARK = "tests/cli.py: this environment needs a cold run: "


class CommandTimedOut(subprocess.TimeoutExpired):
    """A command ran past its time: the report shows the ends of its output, so a hang seen once
    (in CI, under load) can be traced from the test's failure alone."""

    def __str__(self) -> str:
        return (f"{super().__str__()}\nstdout (end):\n{(self.output or '')[-3000:]}"
                f"\nstderr (end):\n{(self.stderr or '')[-5000:]}")


def _decoded(text: str | bytes | None) -> str:
    return text.decode(errors="replace") if isinstance(text, bytes) else (text or "")


def run_warm(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess | None:
    """Run `cmd` (`python -m rltrain ...`, or any `python` command line `python(...)` takes) in a
    child of the warm fork server; None when its
    environment needs a fresh interpreter or the machine has CUDA (helpers.cuda_machine). Stdout and
    stderr go to files the child's file descriptors 1 and 2 point at, so ranks the command starts
    write there too, as with a pipe."""
    import tempfile

    from helpers import cuda_machine

    if cuda_machine():
        return None

    with tempfile.TemporaryDirectory(prefix="rltrain-warm-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        child = _start_warm(cmd, env, out, err, rank_server())
        child.join(timeout)
        if child.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)  # the child and every process it started
            child.join()
            raise CommandTimedOut(cmd, timeout, _text(out), _text(err))
        if _refused(child.exitcode, err):
            return None
        stdout, stderr = _text(out), _text(err)
    assert child.exitcode is not None
    return subprocess.CompletedProcess(cmd, child.exitcode, stdout, stderr)


def _start_warm(cmd: list[str], env: dict[str, str], out: Path, err: Path, rank_server_path: str):
    """Start `cmd` (`python -m rltrain ...`) in a child of the warm fork server (`_warm_entry`), or of
    the rank server's vLLM server when it builds a vLLM engine in its own process (`VllmServerChild`)."""
    from helpers import rank_context

    argv = cmd[1:]
    # What a fresh interpreter puts first on sys.path: the cwd for `-m`, '' for `-c`, the script's directory.
    first = {"-m": str(ROOT), "-c": ""}.get(argv[0], str((ROOT / argv[0]).resolve().parent))
    sys_path = [first, *_cold_sys_path(env)]
    if _builds_vllm_engine_in_process(argv):
        child = VllmServerChild.start(argv, {**env, **stand_in.environment(rank_server_path, env)}, sys_path, out, err,
                                      rank_server_path)
        if child is not None:
            return child
    child = rank_context().Process(target=_warm_entry, args=(argv, env, str(ROOT), sys_path, str(out), str(err),
                                                              rank_server_path))
    child.start()
    return child


def _builds_vllm_engine_in_process(argv: list[str]) -> bool:
    """Whether `python *argv` is a 1-rank RL run whose vLLM engine lives in its own process, read from
    its overrides (the defaults: algo=grpo, rollout=vllm colocated, one rank). A wrong guess costs
    only time: the run is as it would be either way."""
    if argv[:2] != ["-m", "rltrain"]:
        return False
    overrides: dict[str, str] = {}
    for arg in argv[2:]:
        key, equals, value = arg.lstrip("+").partition("=")
        if not equals or key.startswith(("-", "experiment", "hydra/")):  # --cfg, --multirun, recipes, launchers
            return False
        overrides[key] = value
    return (overrides.get("algo", "grpo") in ("grpo", "ppo") and overrides.get("trainer.nproc", "1") == "1"
            and overrides.get("rollout", "vllm") == "vllm" and overrides.get("rollout.process", "colocated") == "colocated")


class VllmServerChild:
    """A warm child forked by the vLLM server of the rank server (tests/rank_server.py), which has
    imported vLLM's engine modules: what `_start_warm` returns for a run that builds an engine in its
    own process, with the face of the multiprocessing.Process it returns otherwise (pid, is_alive,
    join, exitcode). Its stdout and stderr are the files; the server reports its exit status."""

    def __init__(self, sock, reader, pid: int) -> None:
        self.sock, self.reader, self.pid = sock, reader, pid
        self.exitcode: int | None = None

    @classmethod
    def start(cls, argv: list[str], env: dict[str, str], sys_path: list[str], out: Path, err: Path,
              rank_server_path: str) -> VllmServerChild | None:
        """Ask the rank server; None when it declines (no vLLM server, or an environment it refuses)."""
        import socket

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(rank_server_path)
        request = {"argv": argv, "fds": [1, 2], "env": env, "cwd": str(ROOT), "sys_path": sys_path, "vllm": True}
        with open(out, "w") as out_file, open(err, "w") as err_file:
            stand_in.send_message(sock, request, [out_file.fileno(), err_file.fileno()])
        reader = stand_in.LineReader(sock)
        started = reader.next()
        if started is None or "pid" not in started:
            sock.close()
            return None
        return cls(sock, reader, int(started["pid"]))

    def join(self, timeout: float | None = None) -> None:
        if self.exitcode is not None:
            return
        self.sock.settimeout(timeout)
        try:
            ended = self.reader.next()
        except (TimeoutError, BlockingIOError):
            return
        self.exitcode = -signal.SIGKILL if ended is None else int(ended["exit"])
        self.sock.close()

    def is_alive(self) -> bool:
        self.join(0.001)
        return self.exitcode is None


def _refused(exitcode: int | None, err: Path) -> bool:
    """Whether a warm child ended because its environment needs a fresh interpreter."""
    return exitcode == WARM_REFUSED and _text(err).startswith(WARM_REFUSED_MARK)


_RANK_SERVER: list[str] = []


def rank_server() -> str:
    """The socket of this test process's rank server (tests/rank_server.py), started on first use."""
    if not _RANK_SERVER:
        import atexit
        import tempfile
        import time

        directory = tempfile.mkdtemp(prefix="rlrs-")  # short: a socket path has at most 107 bytes
        path = str(Path(directory) / "socket")
        import rank_server as server_module
        from helpers import rank_context

        # A child of the fork server, which has imported PRELOAD with the session's environment
        # (helpers.SESSION_ENV, not a module's changes to os.environ).
        server = rank_context().Process(target=server_module.run, args=(path,), daemon=False)
        server.start()
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        atexit.register(server.kill)  # atexit runs it first, before multiprocessing joins its children
        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            assert server.is_alive() and time.monotonic() < deadline, "the rank server did not start"
            time.sleep(0.02)
        _RANK_SERVER.append(path)
    return _RANK_SERVER[0]


def torchrun_ranks_env() -> dict[str, str]:
    """The environment under which the `python -m rltrain` ranks a test's own `torchrun` starts are
    stand-ins for processes forked from the rank server (tests/stand_in.py, as a launcher's
    `python -m rltrain.worker`); empty on a CUDA machine, where every process starts fresh."""
    from helpers import cuda_machine

    return {} if cuda_machine() else stand_in.environment(rank_server(), dict(os.environ))


def ranks_forked(by_vllm_server: bool = False) -> int:
    """How many ranks (and rollout processes) this test process's rank server has forked; of them,
    with `by_vllm_server`, how many its vLLM server forked (tests/rank_server.py)."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(rank_server())
        stand_in.send_message(sock, {"count": True})
        answer = stand_in.LineReader(sock).next()
    assert answer is not None
    return int(answer["vllm" if by_vllm_server else "forked"])


def _text(path: Path) -> str:
    """What the child wrote there (nothing if it died before opening it)."""
    return path.read_text() if path.exists() else ""


_COLD_SYS_PATH: dict[str, list[str]] = {}


def _cold_sys_path(env: dict[str, str]) -> list[str]:
    """`sys.path` of a fresh interpreter in ROOT with this environment (PYTHONPATH, site), asked once,
    without its first entry (which depends on how the interpreter was asked to run: `_start_warm`)."""
    key = env.get("PYTHONPATH", "")
    if key not in _COLD_SYS_PATH:
        probe = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"], cwd=ROOT,
                               env=env, capture_output=True, text=True, check=True)
        _COLD_SYS_PATH[key] = json.loads(probe.stdout)[1:]
    return _COLD_SYS_PATH[key]


def _warm_entry(argv: list[str], env: dict[str, str], cwd: str, sys_path: list[str], out: str, err: str,
                rank_server_path: str) -> None:
    """In the forked child: become `python *argv` and exit as that interpreter would (non-daemon
    threads joined, atexit handlers run, exit status from SystemExit). Ranks it starts, if any, are
    forked from the rank server (tests/rank_server.py)."""

    os.setpgrp()  # a process group of its own, as a shell gives a command: a timeout kills all of it
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the interpreter's own streams
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    differing = sorted(k for k in set(env) | set(os.environ)
                       if env.get(k) != os.environ.get(k) and not k.startswith(WARM_ENV_PREFIXES)
                       and not (k in SET_BY_PRELOAD and k not in env))
    if differing:
        sys.stderr.write(WARM_REFUSED_MARK + ", ".join(differing) + "\n")
        sys.stderr.flush()
        os._exit(WARM_REFUSED)
    from helpers import adopt, main_of, run_as_interpreter

    adopt(env, cwd, sys_path)
    os.environ.update(stand_in.environment(rank_server_path, env))
    run_as_interpreter(main_of(argv))


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "loss" in r]


class BackgroundRun:
    """`python -m rltrain *args` running while a test watches or signals it, in a process group of
    its own, its output going to files (`finish` reads them).

    It is a warm child (`_start_warm`; cold where `run_warm` would run it cold) whose ranks are
    forked from the rank server: a signal to the group reaches the launcher and the ranks' stand-ins
    at once, and each stand-in's rank with it (forwarded; SIGKILL: the server kills a rank whose
    stand-in died, within its select loop's turn), as a shell's signal would reach every rank."""

    def __init__(self, args: list[str], run_dir: Path, env: dict | None = None) -> None:
        import tempfile

        from helpers import cuda_machine

        self.cmd = [sys.executable, "-m", "rltrain", *args, f"hydra.run.dir={run_dir}"]
        self.env = dict(os.environ, **(env or {}))
        self._tmp = tempfile.TemporaryDirectory(prefix="rltrain-bg-")
        self.out, self.err = Path(self._tmp.name) / "stdout", Path(self._tmp.name) / "stderr"
        self.proc: subprocess.Popen | None = None
        self.child = None if cuda_machine() else _start_warm(self.cmd, self.env, self.out, self.err, rank_server())
        if self.child is None:
            self._start_cold()

    def _start_cold(self) -> None:
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=out, stderr=err, start_new_session=True)

    def poll(self) -> int | None:
        """The exit status; None while it runs (a warm child its environment refused restarts cold)."""
        if self.child is not None:
            if self.child.is_alive():
                return None
            self.child.join()
            if not _refused(self.child.exitcode, self.err):
                return self.child.exitcode
            self.child = None
            self._start_cold()
        assert self.proc is not None
        return self.proc.poll()

    @property
    def pid(self) -> int:
        """The run's process (`python -m rltrain`), which leads its process group."""
        process = self.child if self.child is not None else self.proc
        assert process is not None and process.pid  # each started a group of its own
        return process.pid

    def signal(self, sig: int) -> None:
        """Send `sig` to the run's whole process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def finish(self, timeout: float) -> subprocess.CompletedProcess:
        """Wait up to `timeout` s for the run to end and return its status and output; past it, kill
        the whole group and raise `CommandTimedOut`."""
        import time

        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                self.close()
                raise CommandTimedOut(self.cmd, timeout, _text(self.out), _text(self.err))
            time.sleep(0.05)
        return subprocess.CompletedProcess(self.cmd, code, _text(self.out), _text(self.err))

    def close(self) -> None:
        """SIGKILL the group if the run still runs; remove the output files."""
        if self.poll() is None:
            self.signal(signal.SIGKILL)
            if self.child is not None:
                self.child.join()
            elif self.proc is not None:
                self.proc.wait()
        self._tmp.cleanup()


def kill_when(args: list[str], run_dir: Path, ready: Path, sig: int, timeout: float = 240, env: dict | None = None) -> None:
    """Start `python -m rltrain *args` (a `BackgroundRun`), wait until `ready` exists, then send
    `sig` to its whole group (every rank) and wait for it to end."""
    import time

    run = BackgroundRun(args, run_dir, env)
    deadline = time.monotonic() + timeout
    try:
        while not ready.exists():
            assert run.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, f"{ready} did not appear within {timeout}s"
            time.sleep(0.05)
        run.signal(sig)
        run.finish(timeout=60)
    finally:
        run.close()


def comparable(rows: list[dict]) -> list[dict]:
    """Metric rows without the fields that measure time or memory (they differ run to run), any
    throughput (`tokens_per_s`, `rollout/tokens_per_s`) included."""
    return [
        {k: v for k, v in r.items() if not k.startswith(("time/", "mem/")) and not k.endswith("tokens_per_s")} for r in rows
    ]


# The shared runs' configurations (docs/testing.md, "Shared runs"). Each names every setting its
# readers rely on; a reader that needs a variant runs `[*SFT_RUN, "key=value"]` itself (a later
# override wins) and compares against the shared run.
SFT_RUN = [
    "algo=sft", "trainer.max_steps=6", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
    "trainer.save_every=2", "trainer.eval_every=3", "data.num_eval=8", "logger.wandb.mode=offline",
    "trainer.progress=lines",
]
SFT_RUN_2_RANKS = [*SFT_RUN, "trainer.nproc=2"]
DPO_RUN = [
    "algo=dpo", "trainer.max_steps=6", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
    "trainer.save_every=2", "trainer.eval_every=3", "data.num_eval=8", "logger.wandb.mode=offline",
    "trainer.progress=lines",
    "data.num_train=64",  # 48 pairs train; algo.precompute_ref_logps=true scores all of them (test_cli_dpo.py)
]
# The smaller model on 2 FSDP ranks: the baseline that padding-free and compiled runs are compared with.
SMALL_SFT_RUN_2_RANKS = [
    "algo=sft", "trainer.nproc=2", "trainer.max_steps=3", "trainer.global_batch_size=16", "trainer.micro_batch_size=4",
    "data.num_eval=8", *SMALL_MODEL, *QUICK,
]
GRPO_RUN = [
    "algo=grpo", "model=tiny", "algo.prompts_per_step=4", "algo.group_size=4", "data.num_eval=4",
    "trainer.max_steps=4", "trainer.save_every=2", "trainer.eval_every=2", "logger.wandb.mode=disabled",
    "trainer.progress=lines",
]
GRPO_HF_RUN = [*GRPO_RUN, "rollout=hf"]
# GRPO on 2 ranks with the smaller model, W&B offline: each rank's share of the generation, and
# what a 2-rank run prints.
GRPO_RUN_2_RANKS = [
    "algo=grpo", "model=tiny", *SMALL_MODEL, "algo.prompts_per_step=4", "algo.group_size=2", "data.num_eval=8",
    "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=2", "trainer.save_every=0",
    "trainer.progress=lines", "trainer.nproc=2", "logger.wandb.mode=offline",
]


class SharedRuns:
    """`runs.get(*args)` -> the run directory of `python -m rltrain *args`, run once per session.

    Under pytest-xdist the workers share one directory and a file lock, so a configuration runs
    once whichever worker asks first; the others wait and read it. A failed run is remembered and
    re-raised to every reader. Readers must not write into a shared run: `copy_run` makes a private
    copy (e.g. to corrupt a checkpoint and resume). A shared run is warm, launcher and ranks, like
    any `rltrain(...)` run ("Warm CLI runs" in docs/testing.md), except SFT_RUN's launcher (its one
    rank): that run starts from exactly the command a user types, and the tests that compare their
    warm variants with it (tests/e2e/test_cli_sft.py) hold warm runs to a cold run's numbers, as
    tests/e2e/test_warm_runs.py holds forked ranks."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def get(self, *args: str, timeout: float = 400, env: dict | None = None) -> Path:
        return self.get_with_output(*args, timeout=timeout, env=env)[0]

    def get_with_output(self, *args: str, timeout: float = 400, env: dict | None = None) -> tuple[Path, str, str]:
        """The run directory and what the run printed (stdout, stderr)."""
        from filelock import FileLock

        key = hashlib.sha1(json.dumps([args, sorted((env or {}).items())]).encode()).hexdigest()[:16]
        run_dir = self.root / key
        stdout, stderr = self.root / f"{key}.stdout", self.root / f"{key}.stderr"
        with FileLock(str(self.root / f"{key}.lock")):
            failed = self.root / f"{key}.failed"
            if failed.exists():
                raise AssertionError(f"the shared run failed earlier in this session:\n{failed.read_text()}")
            if not (run_dir / "SHARED_RUN_DONE").exists():
                shutil.rmtree(run_dir, ignore_errors=True)
                try:
                    proc = rltrain(*args, run_dir=run_dir, timeout=timeout, warm=list(args) != SFT_RUN,
                                   env={**(env or {}), **stand_in.environment(rank_server(), {**os.environ, **(env or {})})})
                except BaseException as exc:
                    failed.write_text(str(exc))
                    raise
                stdout.write_text(proc.stdout)
                stderr.write_text(proc.stderr)
                (run_dir / "SHARED_RUN_DONE").write_text(" ".join(args))
        return run_dir, stdout.read_text(), stderr.read_text()


def copy_run(src: Path, dst: Path) -> Path:
    """A private copy of a finished run directory, to resume or damage without touching `src`."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("SHARED_RUN_DONE"))
    return dst
