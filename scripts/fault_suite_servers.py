"""The `rollout=server` rows of `make fault-suite` (docs/rollout-servers.md, "Failure behaviour"):
a spawned server SIGKILLed mid-run, a URL-given server killed and restarted at the same URL, every
server gone, a server of another model, two URLs of one server, a server that fails its handshake
while the fleet forms, and a SIGKILLed trainer's spawned server. Real GRPO runs
on one trainer rank over real vLLM API servers (`python -m rltrain.serve` for the URL-given ones).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from fault_suite import ROOT, Row, finish, first_error, shm_names, start, train_rows

MODEL = ["model=tiny", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
         "model.intermediate_size=128"]
RUN = ["algo=grpo", *MODEL, "algo.prompts_per_step=4", "algo.group_size=2", "rollout=server", "logger.wandb.mode=disabled",
       "trainer.eval_every=0", "trainer.save_every=1", "trainer.progress=lines"]
SPAWNED_PID = re.compile(r"rltrain: rollout server http://[\d.:]+ \(pid (\d+)")


def serve(port: int, log: Path, *overrides: str) -> subprocess.Popen:
    """`python -m rltrain.serve` in a session of its own (so the whole server can be killed)."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "rltrain.serve", "--host", "127.0.0.1", "--port", str(port),
                                 *MODEL, *overrides], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_up(port: int, limit_s: float = 600) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return True
        except OSError:
            time.sleep(1)
    return False


def kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def wait_rows(run_dir: Path, proc: subprocess.Popen, n: int, test: Callable[[dict], bool] = lambda r: True,
              limit_s: float = 600) -> bool:
    deadline = time.monotonic() + limit_s
    while proc.poll() is None and time.monotonic() < deadline:
        rows = train_rows(run_dir)
        if len(rows) >= n and test(rows[-1]):
            return True
        time.sleep(0.2)
    return False


def started(run_dir: Path, overrides: list[str], steps: int) -> tuple[subprocess.Popen, str | None]:
    """A run of `RUN` plus `overrides`, and its row's outcome if it never logs step `steps` (then
    it has exited): every row needs its run under way before it breaks something."""
    proc = start([*RUN, *overrides], run_dir)
    if wait_rows(run_dir, proc, steps):
        return proc, None
    code, err = finish(proc, 60)
    return proc, f"FAILED: no step {steps} (exit {code}: {first_error(err)})"


def spawned_pids(log: str) -> list[int]:
    return [int(p) for p in SPAWNED_PID.findall(Path(log).read_text(errors="replace"))]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def session_members(sid: int) -> list[int]:
    """Processes of session `sid` (a spawned server and vLLM's engine process share its session)."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(entry))
    return out


def spawned_server_killed(base: Path) -> Row:
    run_dir, before = base / "server-killed", shm_names()
    proc, failed = started(run_dir, ["trainer.max_steps=8", "rollout.servers.spawn=2"], 2)
    where = "GRPO, 1 rank, 2 spawned servers"
    if failed:
        return Row("rollout server SIGKILL", where, failed, 0, "-", 0, False)
    victim = spawned_pids(proc.log_path)[1]  # type: ignore[attr-defined]
    os.killpg(victim, signal.SIGKILL)
    killed = time.monotonic()
    code, err = finish(proc, 600)
    rows = train_rows(run_dir)
    last = rows[-1] if rows else {}
    ok = code == 0 and len(rows) == 8 and last.get("rollout/server_failures") == 1 and last.get("rollout/servers_up") == 1
    outcome = f"recovered (server_failures={last.get('rollout/server_failures')}, servers_up={last.get('rollout/servers_up')})"
    return Row("rollout server SIGKILL (after step 2)", where, outcome if ok else f"FAILED: exit {code}: {outcome} {first_error(err)}",
               time.monotonic() - killed, "0", len(shm_names() - before), ok)


def server_restarted(base: Path, ports: list[int], servers: list[subprocess.Popen]) -> Row:
    run_dir, before = base / "server-restarted", shm_names()
    urls = ",".join(f"http://127.0.0.1:{p}" for p in ports)
    proc, failed = started(run_dir, ["trainer.max_steps=100000", f"rollout.servers.urls=[{urls}]"], 2)
    where = "GRPO, 1 rank, 2 URL-given servers"
    if failed:
        return Row("rollout server restarted", where, failed, 0, "-", 0, False)
    kill_session(servers[1])
    killed = time.monotonic()
    down = wait_rows(run_dir, proc, 3, lambda r: r.get("rollout/server_failures") == 1 and r.get("rollout/servers_up") == 1)
    servers[1] = serve(ports[1], base / "server-1-again.log")
    back = down and wait_rows(run_dir, proc, 3, lambda r: r.get("rollout/servers_up") == 2)
    seconds = time.monotonic() - killed
    os.killpg(proc.pid, signal.SIGTERM)
    finish(proc, 120)
    ok = down and back
    outcome = "recovered (counted, then served again at the same URL with the current weights)" if ok else (
        f"FAILED: failure counted: {down}, back at 2 servers: {back}")
    return Row("rollout server killed, restarted at its URL", where, outcome, seconds, "0", len(shm_names() - before), ok)


def all_servers_gone(base: Path, port: int, server: subprocess.Popen) -> Row:
    run_dir, before = base / "servers-gone", shm_names()
    limit = 20
    proc, failed = started(run_dir, ["trainer.max_steps=100000", f"rollout.servers.urls=[http://127.0.0.1:{port}]", f"rollout.timeout_s={limit}"], 2)
    where = "GRPO, 1 rank, 1 URL-given server"
    if failed:
        return Row("every rollout server gone", where, failed, 0, "-", 0, False)
    kill_session(server)
    killed = time.monotonic()
    code, err = finish(proc, limit + 120)
    seconds = time.monotonic() - killed
    named = f"127.0.0.1:{port}" in err
    ok = code not in (0, None) and seconds < limit + 60 and named
    outcome = f"bounded exit (exit {code}: {first_error(err)})"
    return Row("every rollout server gone", where, outcome if ok else f"FAILED: {outcome}, named: {named}", seconds,
               str(len(train_rows(run_dir)) + 1 - _newest(run_dir)), len(shm_names() - before), ok)


def other_model(base: Path, port: int) -> Row:
    run_dir = base / "other-model"
    args = [a if a != "model.num_layers=2" else "model.num_layers=3" for a in RUN]
    t0 = time.monotonic()
    proc = start([*args, "trainer.max_steps=2", f"rollout.servers.urls=[http://127.0.0.1:{port}]"], run_dir)
    code, err = finish(proc, 600)
    ok = code == 2 and "config.json differs" in err
    said = next((line for line in err.splitlines() if line.startswith("rltrain: error:")), first_error(err))
    outcome = f"refused at start (exit {code}: {said[:140]})"
    return Row("rollout server of another model", "GRPO, 1 rank, 1 URL-given server", outcome if ok else f"FAILED: {outcome}",
               time.monotonic() - t0, "0", 0, ok)


def one_server_twice(base: Path, port: int) -> Row:
    """`localhost` and `127.0.0.1`: two names of one server, refused at start naming both."""
    run_dir = base / "one-server-twice"
    urls = [f"http://127.0.0.1:{port}", f"http://localhost:{port}"]
    t0 = time.monotonic()
    proc = start([*RUN, "trainer.max_steps=2", f"rollout.servers.urls=[{','.join(urls)}]"], run_dir)
    code, err = finish(proc, 600)
    said = next((line for line in err.splitlines() if line.startswith("rltrain: error:")), first_error(err))
    ok = code == 2 and all(u in said for u in urls) and "Traceback" not in err
    outcome = f"refused at start (exit {code}: {said[:140]})"
    return Row("two URLs of one rollout server", "GRPO, 1 rank, 1 URL-given server", outcome if ok else f"FAILED: {outcome}",
               time.monotonic() - t0, "0", 0, ok)


class _HandshakeFails(BaseHTTPRequestHandler):
    """A server that answers /health and says who it is, then fails the weight push's handshake."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._send(200, {})

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ok = body.get("method") == "rltrain_server_id"
        self._send(200 if ok else 500, {"results": ["handshake-fails"]} if ok else {"error": "engine died"})

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def handshake_fails(base: Path, port: int) -> Row:
    """A URL-given server that fails its handshake while the fleet forms: down, the run goes on."""
    run_dir, before = base / "handshake-fails", shm_names()
    failing = ThreadingHTTPServer(("127.0.0.1", 0), _HandshakeFails)
    threading.Thread(target=failing.serve_forever, daemon=True).start()
    urls = f"http://127.0.0.1:{port},http://127.0.0.1:{failing.server_address[1]}"
    t0 = time.monotonic()
    proc = start([*RUN, "trainer.max_steps=2", f"rollout.servers.urls=[{urls}]", "rollout.timeout_s=20"], run_dir)
    code, err = finish(proc, 600)
    failing.shutdown()
    rows = train_rows(run_dir)
    last = rows[-1] if rows else {}
    ok = code == 0 and len(rows) == 2 and last.get("rollout/server_failures") == 1 and last.get("rollout/servers_up") == 1
    outcome = f"recovered (server_failures={last.get('rollout/server_failures')}, servers_up={last.get('rollout/servers_up')})"
    return Row("a rollout server failing its handshake at start", "GRPO, 1 rank, 2 URL-given servers",
               outcome if ok else f"FAILED: exit {code}: {outcome} {first_error(err)}", time.monotonic() - t0, "0",
               len(shm_names() - before), ok)


def trainer_sigkilled(base: Path) -> Row:
    run_dir = base / "trainer-killed"
    proc, failed = started(run_dir, ["trainer.max_steps=100000", "rollout.servers.spawn=1"], 1)
    where = "GRPO, 1 rank, 1 spawned server"
    if failed:
        return Row("trainer SIGKILL", where, failed, 0, "-", 0, False)
    server = spawned_pids(proc.log_path)[0]  # type: ignore[attr-defined]
    os.kill(proc.pid, signal.SIGKILL)  # the trainer alone, not its session: the server is in its own
    killed = time.monotonic()
    proc.wait()
    while session_members(server) and time.monotonic() - killed < 30:
        time.sleep(0.2)
    left = session_members(server)
    ok = not left
    outcome = "no spawned server left (died with the trainer)" if ok else f"FAILED: left running: {left}"
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return Row("trainer SIGKILL (spawned server)", where, outcome, time.monotonic() - killed, "-", 0, ok)


def _newest(run_dir: Path) -> int:
    steps = [int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*") if p.name.split("_")[1].isdigit()]
    return max(steps, default=0)


def server_cases() -> list[tuple[str, Callable[..., Row]]]:
    """(name, fn(base)) per row; the URL-given servers are started once and shared by their rows."""
    from rltrain.rollout.server.process import free_port

    shared: dict[str, object] = {}

    def fleet(base: Path) -> tuple[list[int], list[subprocess.Popen]]:
        if "ports" not in shared:
            ports = [free_port(), free_port()]
            shared["ports"] = ports
            shared["procs"] = [serve(p, base / f"server-{i}.log") for i, p in enumerate(ports)]
            for p in ports:
                wait_up(p)
        return shared["ports"], shared["procs"]  # type: ignore[return-value]

    def restarted(base: Path) -> Row:
        ports, procs = fleet(base)
        return server_restarted(base, ports, procs)

    def refused(base: Path) -> Row:
        ports, _ = fleet(base)
        return other_model(base, ports[0])

    def twice(base: Path) -> Row:
        ports, _ = fleet(base)
        return one_server_twice(base, ports[0])

    def handshake(base: Path) -> Row:
        ports, _ = fleet(base)
        return handshake_fails(base, ports[0])

    def gone(base: Path) -> Row:
        ports, procs = fleet(base)
        kill_session(procs[1])
        try:
            return all_servers_gone(base, ports[0], procs[0])
        finally:
            shared.clear()

    return [("server_killed", lambda base: spawned_server_killed(base)), ("server_restarted", restarted),
            ("server_other_model", refused), ("server_twice", twice), ("server_handshake_fails", handshake), ("servers_gone", gone), ("trainer_killed", lambda base: trainer_sigkilled(base))]
