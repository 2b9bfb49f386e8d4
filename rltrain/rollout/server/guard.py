"""The parent of a spawned vLLM API server: `python -m rltrain.rollout.server.guard PARENT_PID CMD...`.

A spawned server must not outlive the trainer, even a SIGKILLed one. `PR_SET_PDEATHSIG` reaches
only the process that asked for it, and vLLM's API server starts its engine and workers as
processes of its own that do not die with it. So the trainer starts this guard in a new session;
the guard asks for SIGTERM when the trainer dies, runs the server in its session, and on SIGTERM
(the trainer's death, or `SpawnedServer.stop`) stops the server and then kills whatever is left of
its session. docs/rollout-servers.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import NoReturn

PR_SET_PDEATHSIG = 1
GRACE_S = 3.0  # the server's own shutdown (nothing of it to keep), before the session is killed
POLL_S = 0.1  # how often the guard looks at its server and its signals


def session_members(sid: int) -> list[int]:
    """Live processes of session `sid` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(entry))
    return out


def main(argv: list[str]) -> int:
    parent, command = int(argv[0]), argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the trainer died before the request took effect
        return 1
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    # The handlers only note the signal; the loop below stops the server. (Stopping inside a handler
    # that interrupted `server.wait()` cannot wait for the server: the interrupted wait holds the
    # lock a second wait needs, so each stop took the whole grace.)
    stops: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stops.append(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: stops.append(signum))
    while not stops:
        if (code := server.poll()) is not None:
            return code
        time.sleep(POLL_S)
    stop(server)
    return 0


def stop(server: subprocess.Popen) -> NoReturn:
    """Stop the server (its own shutdown, up to GRACE_S), then kill what is left of the session."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=GRACE_S)
    me, sid = os.getpid(), os.getsid(0)
    for pid in session_members(sid):
        if pid != me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    time.sleep(0.1)
    os._exit(0)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
