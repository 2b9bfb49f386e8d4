"""Executions on this machine: under bubblewrap (`BwrapSandbox`) or with resource limits only
(`RlimitsSandbox`), each in a process of its own with a wall clock, killed whole when it runs out.

Under bwrap the code sees a read-only view of the system libraries and its interpreter, a private
tmpfs as /tmp, no network and no other process (own pid, net, ipc and uts namespaces); started as
root, it runs under a user id of its own, so the process limit counts only its processes and it can
signal nothing of ours. rlimits isolates neither files nor network. docs/rewards-and-roles.md.
"""

from __future__ import annotations

import contextlib
import os
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

from rltrain.config.schema import SandboxConfig
from rltrain.rewards.sandbox.base import Execution, Outcome, finished, new_nonce, payload, rlimits

UID_BASE = 10_000_000  # sandbox user ids: UID_BASE + pid * MAX_SLOTS + slot, unique among live executions
MAX_SLOTS = 64
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


def launcher_source() -> str:
    return (Path(__file__).parent / "launcher.py").read_text()


def default_python() -> str:
    """The interpreter rltrain runs on, outside its virtual environment (no packages of ours)."""
    return getattr(sys, "_base_executable", None) or sys.executable


@cache
def interpreter_dirs(python: str) -> tuple[str, ...]:
    """The directories `python` needs (its prefixes and its own folder), outside the system dirs."""
    probe = "import sys, json; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))"
    out = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True, timeout=60, check=True).stdout
    import json

    dirs = {os.path.realpath(d) for d in json.loads(out)} | {os.path.dirname(os.path.realpath(python))}
    return tuple(sorted(d for d in dirs if not any(d == s or d.startswith(s + "/") for s in SYSTEM_DIRS)))


class Slots:
    """User ids for the executions running at once in this process (root only)."""

    def __init__(self) -> None:
        self.free: queue.Queue[int] = queue.Queue()
        for slot in range(MAX_SLOTS):
            self.free.put(slot)

    def take(self) -> int:
        return UID_BASE + os.getpid() * MAX_SLOTS + self.free.get()

    def give_back(self, uid: int) -> None:
        self.free.put((uid - UID_BASE) % MAX_SLOTS)


def user_tasks(uid: int) -> list[int]:
    """Pids of the processes running as `uid` (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    pids.append(int(entry))
    return pids


def communicate(proc: subprocess.Popen, data: bytes, timeout_s: float, max_bytes: int) -> tuple[bytes, bytes, str]:
    """Feed `data` to stdin and read stdout and stderr until the process closes them; returns them
    and "" or the limit it broke ("timeout", "output"): the caller then kills the process."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    deadline = time.monotonic() + timeout_s
    stdin_fd, readers = proc.stdin.fileno(), (proc.stdout.fileno(), proc.stderr.fileno())
    out = {fd: bytearray() for fd in readers}
    pending = memoryview(data)
    with selectors.DefaultSelector() as sel:
        for fd in (stdin_fd, *readers):
            os.set_blocking(fd, False)
        sel.register(stdin_fd, selectors.EVENT_WRITE)
        for fd in readers:
            sel.register(fd, selectors.EVENT_READ)
        broke = ""
        while any(fd in sel.get_map() for fd in readers) and not broke:
            left = deadline - time.monotonic()
            events = sel.select(left) if left > 0 else []
            if left <= 0:
                broke = "timeout"
            for key, _ in events:
                if key.fd == stdin_fd:
                    try:
                        pending = pending[os.write(stdin_fd, pending[:65536]) :]
                    except OSError:  # it closed its stdin
                        pending = memoryview(b"")
                    if not pending:
                        sel.unregister(stdin_fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                out[key.fd] += chunk
                if sum(len(b) for b in out.values()) > max_bytes:
                    broke = "output"
    return bytes(out[readers[0]]), bytes(out[readers[1]]), broke


class LocalSandbox:
    """What both local modes share: start, bound, kill, classify."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self.python = cfg.python or default_python()
        self.launcher = launcher_source()
        self.root = os.geteuid() == 0
        self.slots = Slots()

    def process_limit(self, uid: int | None) -> int:
        """RLIMIT_NPROC counts a user's processes machine-wide: a user of its own gets the limit, a
        shared one the limit on top of what it already runs."""
        if uid is not None:
            return self.cfg.processes
        threads = 0
        for pid in user_tasks(os.geteuid()):
            with contextlib.suppress(OSError):
                threads += len(os.listdir(f"/proc/{pid}/task"))
        return self.cfg.processes + threads

    def run(self, execution: Execution) -> Outcome:
        uid = self.slots.take() if self.root else None
        workdir = None
        try:
            argv, cwd, workdir = self.command(uid)
            nonce = new_nonce()
            limits = rlimits(self.cfg, self.process_limit(uid))
            data = payload(execution, nonce, limits, uid, cwd, self.parent_death(), self.preload if uid is not None else ())
            return self.execute(argv, data, nonce, uid, workdir)
        finally:
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
            if uid is not None:
                self.slots.give_back(uid)

    def command(self, uid: int | None) -> tuple[list[str], str, str | None]:
        """(argv, the code's working directory, a host directory to delete afterwards)."""
        raise NotImplementedError

    # Imported before the user change: its own user id may not read an interpreter kept in a private
    # directory (pyenv under /root); under bwrap the interpreter's directories are bound readable.
    preload: tuple[str, ...] = (
        "ctypes", "collections", "itertools", "functools", "heapq", "bisect", "math", "cmath", "re", "string", "random",
        "statistics", "decimal", "fractions", "typing", "dataclasses", "copy", "operator", "array", "json", "io", "time",
    )

    def parent_death(self) -> int:
        """The pid whose death kills the launcher (a killed reward worker leaves no code running)."""
        return os.getpid()

    def execute(self, argv: list[str], data: bytes, nonce: str, uid: int | None, workdir: str | None) -> Outcome:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir or "/",
            env=dict(CLEAN_ENV, HOME=workdir or "/tmp", TMPDIR=workdir or "/tmp"), start_new_session=True,
        )
        try:
            stdout, stderr, broke = communicate(proc, data, self.cfg.timeout_s, self.cfg.output_bytes)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # under bwrap its namespace dies with its outer process
            proc.wait()
            self.sweep(uid)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                f.close()
        if stderr.startswith(b"bwrap: "):  # the sandbox itself failed: never read as the code's failure
            raise RuntimeError(f"bubblewrap could not start the sandbox: {stderr.decode(errors='replace').strip()[:500]}")
        if broke == "timeout":
            return Outcome("timeout", stdout.decode(errors="replace"), f"past reward.sandbox.timeout_s={self.cfg.timeout_s:g} s")
        if broke == "output":
            return Outcome("killed", "", f"more than reward.sandbox.output_bytes={self.cfg.output_bytes} bytes of output")
        return finished(stdout, stderr, nonce, *self.ending(proc.returncode))

    def ending(self, returncode: int) -> tuple[int | None, int]:
        """(the signal that ended the process or None, its exit status)."""
        return (-returncode, 0) if returncode < 0 else (None, returncode)

    def sweep(self, uid: int | None) -> None:
        """Kill what the execution left running under its user id and wait until it is gone: under
        bwrap its namespace dies after its outer process, under rlimits a process may have left
        its group. (A user id shared with rltrain, when not root, cannot be swept.)"""
        if uid is None:
            return
        for _ in range(500):  # a fork bomb may still fork between a scan and its kills
            pids = user_tasks(uid)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)


class BwrapSandbox(LocalSandbox):
    preload = ()

    def __init__(self, cfg: SandboxConfig) -> None:
        super().__init__(cfg)
        self.bwrap = require_bwrap()
        self.binds = self.mounts()

    def mounts(self) -> list[str]:
        args: list[str] = []
        for d in SYSTEM_DIRS:
            if os.path.islink(d):
                args += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                args += ["--ro-bind", d, d]
        made: set[str] = set()
        for d in interpreter_dirs(self.python):
            parts = Path(d).parts
            for i in range(2, len(parts)):  # its parents, searchable by the sandbox's user
                parent = str(Path(*parts[:i]))
                if parent not in made:
                    made.add(parent)
                    args += ["--perms", "0755", "--dir", parent]
            args += ["--ro-bind", d, d]
        return args

    def command(self, uid: int | None) -> tuple[list[str], str, str | None]:
        caps = ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if self.root else []
        argv = [
            self.bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", *caps, *self.binds,
            "--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(self.cfg.tmp_mb * 1024 * 1024), "--tmpfs", "/tmp",
            "--chdir", "/tmp", "--clearenv", *[a for k, v in CLEAN_ENV.items() for a in ("--setenv", k, v)],
            "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp",
            "--", self.python, "-I", "-c", self.launcher,
        ]
        return argv, "/tmp", None

    def parent_death(self) -> int:
        return 0  # --die-with-parent: the outer bwrap, and so the namespace, dies with the reward worker

    def ending(self, returncode: int) -> tuple[int | None, int]:
        if returncode > 128 and returncode - 128 in signal.Signals._value2member_map_:  # bwrap: 128 + the signal
            return returncode - 128, returncode
        return super().ending(returncode)


class RlimitsSandbox(LocalSandbox):
    """Limits only: the code runs with the files and network its user id reaches."""

    def command(self, uid: int | None) -> tuple[list[str], str, str | None]:
        workdir = tempfile.mkdtemp(prefix="rltrain-sandbox-")
        if uid is not None:
            os.chown(workdir, uid, uid)
        return [self.python, "-I", "-c", self.launcher], workdir, workdir


BWRAP_MISSING = (
    "reward.sandbox.mode=bwrap runs model-written code under bubblewrap, and `bwrap` is not on this machine's PATH. "
    "Install it (Debian/Ubuntu: `sudo apt-get install -y bubblewrap`; Fedora: `sudo dnf install bubblewrap`; "
    "`make install` does it where it runs as root), or choose reward.sandbox.mode=rlimits (resource limits only: "
    "the code can then read and write whatever this user can and reach the network) or "
    "reward.sandbox.mode=remote reward.sandbox.url=http://HOST:PORT (a SandboxFusion service)."
)


def require_bwrap() -> str:
    from rltrain.runtime.errors import UserError

    path = shutil.which("bwrap")
    if path is None:
        raise UserError(BWRAP_MISSING)
    return path


def works_here(cfg: SandboxConfig) -> None:
    """bwrap is installed and can build the sandbox on this machine (namespaces allowed): one
    trivial execution, or a UserError saying what to do."""
    from rltrain.runtime.errors import UserError

    require_bwrap()
    try:
        outcome = BwrapSandbox(cfg).run(Execution("pass"))
        problem = "" if outcome.status == "ran" else f"{outcome.status}: {outcome.detail.strip()[-500:]}"
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        problem = str(exc)
    if problem:
        raise UserError(
            f"reward.sandbox.mode=bwrap cannot run code on this machine ({problem}). Where unprivileged user namespaces "
            "are disabled, run as root or allow them (sysctl kernel.unprivileged_userns_clone=1); check "
            "reward.sandbox.python; or choose reward.sandbox.mode=rlimits (no file or network isolation) or "
            "reward.sandbox.mode=remote reward.sandbox.url=http://HOST:PORT."
        )
