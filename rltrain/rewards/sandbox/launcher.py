"""The program each sandboxed execution runs first: `python -I -c <this file's source>`.

It reads a length-prefixed JSON payload from stdin, sets the resource limits, leaves root for the
execution's own user id, and runs the code in this interpreter. Only a program that runs to its end
(or, where `exit_ends`, exits 0) prints the payload's nonce as stdout's last line, so `sys.exit(0)`
before the tests is no pass; the rest of stdin is the program's. Standard library only: sent as source.
"""

import json
import os
import resource
import sys
import traceback


def read_exactly(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def read_payload():
    header = b""
    while not header.endswith(b"\n"):
        byte = os.read(0, 1)
        if not byte:
            break
        header += byte
    return json.loads(read_exactly(int(header)))


def confine(payload):
    for name in payload["preload"]:  # what its user may be unable to read (an interpreter under /root)
        __import__(name)
    for name, soft_hard in payload["rlimits"].items():
        resource.setrlimit(getattr(resource, name), tuple(soft_hard))
    uid = payload["uid"]
    if uid is not None and os.geteuid() == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    if payload["parent_death"]:  # set after the user change, which clears it
        sys.modules["ctypes"].CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: die with the process that started it
        if os.getppid() != payload["parent_death"]:
            os._exit(1)
    os.chdir(payload["cwd"])


def main():
    payload = read_payload()
    nonce = payload.pop("nonce")
    confine(payload)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(payload.pop("program"), "solution.py", "exec"), namespace)
    except SystemExit as exc:
        if not (payload["exit_ends"] and exc.code in (None, 0)):
            sys.stdout.flush()
            os._exit(exc.code if isinstance(exc.code, int) and exc.code != 0 else 1)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.write("\n" + nonce + "\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
