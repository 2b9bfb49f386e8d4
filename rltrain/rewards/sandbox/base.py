"""What a sandbox runs and what came of it: one `Execution` (a program, its stdin) -> one `Outcome`.

Each execution's status is one of: `ran` (it ran to its end; its stdout is then compared), `error`
(it raised or exited non-zero), `timeout` (past the wall clock or its CPU seconds) or `killed` (the
sandbox stopped it for another limit: output bytes, file size, memory, a signal).
"""

from __future__ import annotations

import secrets
import signal
from dataclasses import dataclass
from typing import Literal, Protocol

from rltrain.config.schema import SandboxConfig

Status = Literal["ran", "error", "timeout", "killed"]
LAUNCHER_MODULE = "rltrain.rewards.sandbox.launcher"


@dataclass
class Execution:
    program: str  # Python source, run as __main__
    stdin: str = ""
    exit_ends: bool = True  # sys.exit(0) counts as running to its end (stdin/stdout programs; not tests)


@dataclass
class Outcome:
    status: Status
    stdout: str = ""
    detail: str = ""  # why it did not run to its end (stderr's tail, the limit it broke)


class Sandbox(Protocol):
    """Runs one execution in isolation, within `SandboxConfig`'s limits; safe to call from threads."""

    def run(self, execution: Execution) -> Outcome: ...


def payload(
    execution: Execution, nonce: str, rlimits: dict[str, tuple[int, int]], uid: int | None, cwd: str, parent_death: int = 0,
    preload: tuple[str, ...] = (),
) -> bytes:
    """The launcher's stdin: its length-prefixed JSON payload, then the program's stdin.
    `parent_death`: the pid whose death kills the launcher (0: none); `preload`: modules it
    imports before it leaves root."""
    import json

    body = json.dumps({
        "program": execution.program, "nonce": nonce, "rlimits": rlimits, "uid": uid, "cwd": cwd,
        "exit_ends": execution.exit_ends, "parent_death": parent_death, "preload": list(preload),
    }).encode()
    return str(len(body)).encode() + b"\n" + body + execution.stdin.encode()


def new_nonce() -> str:
    return "rltrain-end-" + secrets.token_hex(16)


def rlimits(cfg: SandboxConfig, processes: int) -> dict[str, tuple[int, int]]:
    """The `resource.setrlimit` limits of one execution (names, as the launcher resolves them)."""
    mib = 1024 * 1024
    return {
        "RLIMIT_CPU": (cfg.cpu_s, cfg.cpu_s + 1),
        "RLIMIT_AS": (cfg.memory_mb * mib, cfg.memory_mb * mib),
        "RLIMIT_FSIZE": (cfg.file_size_mb * mib, cfg.file_size_mb * mib),
        "RLIMIT_NPROC": (processes, processes),
        "RLIMIT_CORE": (0, 0),
    }


def finished(stdout: bytes, stderr: bytes, nonce: str, signal_number: int | None, exit_code: int) -> Outcome:
    """The outcome of a process that ended by itself (`signal_number`: the signal that ended it)."""
    text = stdout.decode(errors="replace")
    tail = stderr.decode(errors="replace")[-2000:]
    if signal_number is not None:
        name = signal.Signals(signal_number).name if signal_number in signal.Signals._value2member_map_ else str(signal_number)
        status: Status = "timeout" if signal_number == signal.SIGXCPU else "killed"
        return Outcome(status, text, f"ended by {name}")
    end = f"\n{nonce}\n"
    if exit_code == 0 and text.endswith(end):
        return Outcome("ran", text[: -len(end)])
    return Outcome("error", text, tail or f"exit status {exit_code}" + ("" if exit_code else " before its end"))
