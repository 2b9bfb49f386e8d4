"""A worker of rltrain.runtime.call_pool: `python -m rltrain.runtime.call_worker IN OUT PARENT_PID`.

Reads [sys.path, paths, threaded] first and imports those functions, reports ready, then answers
calls [index, path, kwargs] with [kind, index, payload]: ["ok", i, value] or ["error", i, "Type:
message"] (JSON messages). Unthreaded, it runs one call at a time in its main thread; threaded, each
call in a thread of its own, as many at once as the pool sends (it counts the slots). A function
that returns an awaitable has it awaited on an event loop of its own, in its thread
(rltrain/runtime/watched_loop.py), whose watchdog reports a call that blocks its loop as
["blocked", i, null]. It never decides about time: the pool gives up on a call that runs too long
and kills the worker once it runs nothing else.
"""

from __future__ import annotations

import inspect
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any


def serve(inbox: Connection, outbox: Connection) -> None:
    from rltrain.runtime.call_pool import receive, send
    from rltrain.runtime.errors import UserError
    from rltrain.runtime.user_code import load_callable
    from rltrain.runtime.watched_loop import WatchedLoops

    parent_path, paths, threaded = receive(inbox)
    # The trainer's import path in its own order: an entry it appended last (setuptools adds its
    # `_vendor` folder) must not come before site-packages here.
    sys.path[:] = parent_path + [p for p in sys.path if p not in parent_path]
    try:
        fns = {path: load_callable("user function", path) for path in paths}
    except UserError as exc:
        send(outbox, ["load_error", None, str(exc)])
        return
    lock = threading.Lock()  # one message at a time on the pipe
    loops: list[WatchedLoops] = []  # made at the first awaitable
    loop_lock = threading.Lock()

    def blocked(index: int) -> None:
        with lock:
            send(outbox, ["blocked", index, None])

    def awaited(index: int, value: Any) -> Any:
        with loop_lock:
            if not loops:
                loops.append(WatchedLoops(blocked))
        return loops[0].run(index, value)

    def answer(index: int, path: str, kwargs: dict[str, Any]) -> None:
        try:
            value = fns[path](**kwargs)
            message = ["ok", index, awaited(index, value) if inspect.isawaitable(value) else value]
        except Exception as exc:  # noqa: BLE001 - reported to the pool, which counts it
            message = ["error", index, f"{type(exc).__name__}: {exc}"]
        with lock:
            try:
                send(outbox, message)
            except (TypeError, ValueError) as exc:  # a value JSON cannot carry is the function's error
                send(outbox, ["error", index, f"TypeError: {exc}"])

    send(outbox, ["ready", None, None])
    while True:
        try:
            index, path, kwargs = receive(inbox)
        except EOFError:
            return
        if threaded:
            threading.Thread(target=answer, args=(index, path, kwargs), daemon=True).start()
        else:
            answer(index, path, kwargs)


def main(argv: list[str]) -> None:
    from rltrain.runtime.parent_death import die_with_parent

    fd_in, fd_out, parent_pid = (int(a) for a in argv)
    die_with_parent(parent_pid)
    serve(Connection(fd_in, writable=False), Connection(fd_out, readable=False))


if __name__ == "__main__":
    main(sys.argv[1:])
