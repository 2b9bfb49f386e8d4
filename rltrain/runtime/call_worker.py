"""A worker of rltrain.runtime.call_pool: `python -m rltrain.runtime.call_worker IN OUT PARENT_PID`.

Reads [sys.path, paths] first and imports those functions, reports ready, then answers one call at
a time: ["ok", value] or ["error", "Type: message"] (JSON messages). It never decides about time: the pool kills
it when a call runs too long.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection


def serve(inbox: Connection, outbox: Connection) -> None:
    from rltrain.runtime.call_pool import receive, send
    from rltrain.runtime.errors import UserError
    from rltrain.runtime.user_code import load_callable

    parent_path, paths = receive(inbox)
    sys.path[:0] = [p for p in parent_path if p not in sys.path]
    try:
        fns = {path: load_callable("user function", path) for path in paths}
    except UserError as exc:
        send(outbox, ["load_error", str(exc)])
        return
    send(outbox, ["ready", None])
    while True:
        try:
            path, kwargs = receive(inbox)
        except EOFError:
            return
        try:
            value = fns[path](**kwargs)
            send(outbox, ["ok", value])
        except Exception as exc:  # noqa: BLE001 - reported to the pool, which counts it
            send(outbox, ["error", f"{type(exc).__name__}: {exc}"])


def main(argv: list[str]) -> None:
    from rltrain.runtime.parent_death import die_with_parent

    fd_in, fd_out, parent_pid = (int(a) for a in argv)
    die_with_parent(parent_pid)
    serve(Connection(fd_in, writable=False), Connection(fd_out, readable=False))


if __name__ == "__main__":
    main(sys.argv[1:])
