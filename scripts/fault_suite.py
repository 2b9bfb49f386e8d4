"""`make fault-suite`: every failure rltrain promises to survive or end cleanly, made to happen, in a table.

On 2 CPU ranks and both backends, each `debug.fault` kind (docs/failure-behaviour.md, "Fault injection") in a real
`python -m rltrain algo=sft` run of 8 steps with the fault at step 3; then a rollout child killed
in a real 2-rank GRPO run (`rollout.process=separate`, both backends), and killed or frozen while the engine
generates ahead (`placement.max_staleness=1`); then the weight transport on its own: a
receiver process killed in the middle of a sync, and a sync whose bucket message is lost; then
`env=agent` (scripts/fault_suite_agents.py): agents blocked on one prompt in eight (their event loop,
their thread, the CPU, an await that never returns); then `rollout=server`
(scripts/fault_suite_servers.py): a server killed, restarted, all gone, of another model, two URLs
of one server, and a SIGKILLed trainer's spawned server; then in-flight updates with streaming
(scripts/fault_suite_inflight.py): the trainer SIGKILLed mid-stream and resumed, over the separate
engine and over a server, and a server SIGKILLed mid-stream.

One row per fault:

- outcome: `recovered` (the run completed every step; what the metrics counted), `bounded exit`
  (non-zero status within the time docs/failure-behaviour.md promises; the first error line), or `FAILED` where
  the behaviour is not the promised one (the script then exits 1, as it does for a file left in
  /dev/shm);
- seconds: the whole run (for a kill, from the kill to the exit; for the transport, to the error);
- steps lost: the steps a resume must redo: the step the run had reached minus its newest checkpoint
  (every run checkpoints every step; 0 for a run that completed all its steps);
- /dev/shm: files the run left there (rltrain's segments are unlinked at creation: always 0).

    .venv/bin/python scripts/fault_suite.py [--only NAME ...] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 30  # safety.collective_timeout_s of every run
MAX_STEPS = 8
FAULT_STEP = 3
SMALL = [
    "algo=sft",
    "trainer.nproc=2",
    f"trainer.max_steps={MAX_STEPS}",
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=128",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=4",
    "data.num_eval=4",
    f"safety.collective_timeout_s={TIMEOUT_S}",
    "logger.wandb.mode=disabled",
    "trainer.eval_every=0",
    "trainer.save_every=1",
    "trainer.progress=lines",
]
GRPO = [
    "algo=grpo",
    "model=tiny",  # not the SFT start algo=grpo defaults to: these runs test failures, not learning
    "trainer.nproc=2",
    f"trainer.max_steps={MAX_STEPS}",
    "algo.prompts_per_step=4",
    "algo.group_size=4",
    "data.num_eval=4",
    "rollout.process=separate",
    f"rollout.timeout_s={TIMEOUT_S}",
    f"safety.collective_timeout_s={TIMEOUT_S}",
    "logger.wandb.mode=disabled",
    "trainer.eval_every=0",
    "trainer.save_every=1",
    "trainer.progress=lines",
]
# kind -> (the fault's rank, the outcome docs/failure-behaviour.md promises: recovered | exit)
KINDS = {
    "loss_error": (1, "recovered"),
    "backward_error": (1, "recovered"),
    "nan_grad": (0, "recovered"),
    "rollout_dead": (0, "recovered"),
    "device_error": (1, "exit"),
    "kill": (1, "exit"),
}


@dataclass
class Row:
    fault: str
    where: str
    outcome: str
    seconds: float
    steps_lost: str
    shm_left: int
    ok: bool


def shm_names() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("rltrain")}
    except OSError:
        return set()


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "loss" in r]


EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Fault|Exception|Aborted|Closed|Timeout)\w*: ")


def first_error(output: str) -> str:
    """The line that says what happened: a lost rank; else the error rltrain raised on the first
    rank that failed (the outermost of a chain: the last one before the launcher's report); else
    the first exception; else rltrain's one-paragraph error; else rltrain's own line."""
    lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in output.splitlines()]
    exited = next((i for i, line in enumerate(lines) if re.match(r"rltrain: rank \d+ exited", line)), len(lines))
    picks = (
        [line for line in lines if line.startswith("rltrain: ") and "killed by" in line][:1]
        or [line for line in lines[:exited] if re.match(r"rltrain\.[\w.]+: ", line)][-1:]
        or [line for line in lines if EXCEPTION_LINE.match(line)][:1]
        or [line for line in lines if line.startswith("rltrain: error: ")][:1]
        or [line for line in lines if line.startswith("rltrain: ")][:1]
        or lines[-1:]
    )
    return re.sub(r"^[\w.]*\.(?=\w+: )", "", picks[0].strip())[:100] if picks else ""


def newest_checkpoint(run_dir: Path) -> int:
    steps = [int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*") if p.name.split("_")[1].isdigit()]
    return max(steps, default=0)


def start(args: list[str], run_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m rltrain *args` in its own session (`env` added to its environment), its output
    (every rank's) to `<run_dir>.log`."""
    cmd = [sys.executable, "-m", "rltrain", *args, f"hydra.run.dir={run_dir}"]
    log = open(f"{run_dir}.log", "w")  # a file, not a pipe: a chatty run never blocks on a full pipe
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})
    proc.log_path = log.name  # type: ignore[attr-defined]
    log.close()
    return proc


def finish(proc: subprocess.Popen, limit_s: float) -> tuple[int | None, str]:
    try:
        code = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    return code, Path(proc.log_path).read_text(errors="replace")


def deep_health_503(run_dir: Path, proc: subprocess.Popen) -> bool:
    """Poll rank 0's /healthz/deep until it answers 503 or the run ends."""
    while proc.poll() is None:
        try:
            port = json.loads((run_dir / "health.json").read_text())["port"]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz/deep", timeout=5):
                pass
        except urllib.error.HTTPError as err:
            if err.code == 503:
                return True
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    return False


def debug_fault(kind: str, backend: str, base: Path) -> Row:
    rank, promise = KINDS[kind]
    run_dir = base / f"{backend}-{kind}"
    args = [*SMALL, f"backend={backend}", f"debug.fault={kind}:{rank}:{FAULT_STEP}"]
    if kind == "rollout_dead":
        args.append("health.port=0")
    before = shm_names()
    t0 = time.monotonic()
    proc = start(args, run_dir)
    saw_503 = deep_health_503(run_dir, proc) if kind == "rollout_dead" else False
    code, err = finish(proc, 240)
    seconds = time.monotonic() - t0
    rows = train_rows(run_dir)
    lost = FAULT_STEP - newest_checkpoint(run_dir) if code else 0  # the run reached the fault's step
    shm_left = len(shm_names() - before)
    if code == 0:
        recovered = sum(r.get("safety/recovered_errors", 0) for r in rows)
        skipped = sum(r.get("safety/skipped_steps", 0) for r in rows)
        detail = {"loss_error": f"recovered_errors={recovered:g}", "backward_error": f"recovered_errors={recovered:g}",
                  "nan_grad": f"skipped_steps={skipped:g}", "rollout_dead": f"/healthz/deep 503: {saw_503}"}.get(kind, "")
        ok = promise == "recovered" and len(rows) == MAX_STEPS and {
            "loss_error": recovered == 1, "backward_error": recovered == 1, "nan_grad": skipped == 1,
            "rollout_dead": saw_503}[kind]
        outcome = f"recovered ({detail})"
    else:
        what = "killed at the time limit" if code is None else f"exit {code}"
        ok = promise == "exit" and code is not None and seconds < TIMEOUT_S + 90
        outcome = f"bounded exit ({what}: {first_error(err)})"
    return Row(f"{kind}:{rank}:{FAULT_STEP}", f"{backend}, 2 ranks", outcome if ok else f"FAILED: {outcome}",
               seconds, str(lost), shm_left, ok)


def rollout_children(root_pid: int) -> list[int]:
    """Pids of `rltrain.rollout.separate_child` processes descended from `root_pid`."""
    parents: dict[int, int] = {}
    cmdlines: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            cmdlines[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue

    def descends(pid: int) -> bool:
        while pid > 1:
            if pid == root_pid:
                return True
            pid = parents.get(pid, 0)
        return False

    return [p for p, cmd in cmdlines.items() if "rltrain.rollout.separate_child" in cmd and descends(p)]


def killed_rollout_child(backend: str, base: Path, staleness: int = 0, sig: int = signal.SIGKILL) -> Row:
    """The rollout child killed (SIGKILL) or frozen (SIGSTOP: it stops answering) after step 2;
    with `staleness` >= 1 the engine is generating ahead, a batch in flight on its worker thread."""
    name = f"rollout child {signal.Signals(sig).name}" + (f", placement.max_staleness={staleness}" if staleness else "")
    run_dir = base / f"{backend}-grpo-{signal.Signals(sig).name}-child-k{staleness}"
    where = f"{backend} GRPO, separate engine, 2 ranks"
    before = shm_names()
    args = [*GRPO, f"backend={backend}", f"placement.max_staleness={staleness}"]
    if sig == signal.SIGSTOP:  # as the defaults are (300 s against 600 s): the engine's bound under the collectives'
        args = [a if not a.startswith("rollout.timeout_s=") else f"rollout.timeout_s={TIMEOUT_S // 2}" for a in args]
    proc = start(args, run_dir)
    deadline = time.monotonic() + 600
    while len(train_rows(run_dir)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    children = rollout_children(proc.pid)
    if proc.poll() is not None or not children:
        code, err = finish(proc, 60)
        return Row(name, where, f"FAILED: could not signal a child (exit {code}: {first_error(err)})", 0.0, "-", 0, False)
    os.kill(children[0], sig)
    killed = time.monotonic()
    code, err = finish(proc, TIMEOUT_S + 120)
    seconds = time.monotonic() - killed
    reached = len(train_rows(run_dir)) + 1  # the step in flight when the child died
    lost = reached - newest_checkpoint(run_dir)
    ok = code not in (0, None) and seconds < TIMEOUT_S + 90
    what = "killed at the time limit" if code is None else f"exit {code}"
    outcome = f"bounded exit ({what}: {first_error(err)})" if code else f"completed (exit {code})"
    return Row(f"{name} (after step 2)", where,
               outcome if ok else f"FAILED: {outcome}", seconds, str(lost), len(shm_names() - before), ok)


def _stalling_receiver(control_path: str, arrived) -> None:
    from rltrain.transport.receiver import WeightReceiver

    for _ in WeightReceiver(control_path, timeout_s=60).receive():
        arrived.set()
        time.sleep(120)  # killed long before this ends


def transport_case(kind: str) -> Row:
    import torch

    from rltrain.transport.receiver import WeightReceiver
    from rltrain.transport.sender import WeightSender

    timeout_s = 20.0
    weights = [(f"w{i}", torch.randn(200)) for i in range(20)]  # 800 B each: one per 1 KiB bucket
    before = shm_names()
    outcome: dict = {}
    with tempfile.TemporaryDirectory(prefix="rlfs") as base_dir:
        hook = (lambda m: [] if m["type"] == "bucket" and m["bucket_id"] == 1 else [m]) if kind == "lost" else None
        with WeightSender(bucket_bytes=1024, timeout_s=timeout_s, base_dir=Path(base_dir), fault_hook=hook) as sender:

            def send() -> None:
                try:
                    sender.send(weights)
                except Exception as exc:  # noqa: BLE001 - reported in the table
                    outcome["error"] = exc
                outcome["at"] = time.monotonic()

            thread = threading.Thread(target=send, daemon=True)
            if kind == "lost":
                receiver = WeightReceiver(sender.control_path, timeout_s=timeout_s)
                t0 = time.monotonic()
                thread.start()
                try:
                    for _ in receiver.receive():
                        pass
                except Exception as exc:  # noqa: BLE001 - reported in the table
                    outcome["receiver"] = exc
                thread.join(timeout_s + 10)
                fault, where = "sync message lost (bucket 1 dropped)", "weight transport, 2 threads"
            else:
                ctx = multiprocessing.get_context("spawn")
                arrived = ctx.Event()
                child = ctx.Process(target=_stalling_receiver, args=(str(sender.control_path), arrived), daemon=True)
                child.start()
                thread.start()
                arrived.wait(60)
                child.kill()
                t0 = time.monotonic()
                thread.join(timeout_s + 10)
                child.join(10)
                fault, where = "weight receiver SIGKILL (mid-sync)", "weight transport, 2 processes"
    seconds = outcome.get("at", time.monotonic()) - t0
    error = outcome.get("error")
    ok = error is not None and not thread.is_alive() and seconds < timeout_s
    text = f"{type(error).__name__}: {error}"[:90] if error else "no error"
    if kind == "lost":
        text = f"{text}; receiver: {type(outcome.get('receiver')).__name__}"
    outcome_text = f"bounded exit (sender raised {text})"
    return Row(fault, where, outcome_text if ok else f"FAILED: {outcome_text}", seconds, "-",
               len(shm_names() - before), ok)


def table(rows: list[Row]) -> str:
    lines = ["| fault | where | outcome | seconds | steps lost | files left in /dev/shm |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        outcome = r.outcome.replace("|", "/")
        lines.append(f"| `{r.fault}` | {r.where} | {outcome} | {r.seconds:.2f} | {r.steps_lost} | {r.shm_left} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", help="case names: KIND@BACKEND, rollout_child@BACKEND, async_sigkill@BACKEND, async_sigstop@BACKEND, receiver, lost, agent_loop_sleep, agent_spins, agent_never_returns, agent_thread_sleep, server_killed, server_restarted, server_other_model, server_twice, server_handshake_fails, servers_gone, trainer_killed, inflight_trainer_killed@separate, inflight_trainer_killed@server, inflight_server_killed")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cases = [(f"{k}@{b}", lambda k=k, b=b, base=None: debug_fault(k, b, base)) for b in ("fsdp", "megatron") for k in KINDS]
    cases += [(f"rollout_child@{b}", lambda b=b, base=None: killed_rollout_child(b, base)) for b in ("fsdp", "megatron")]
    # Generating ahead (docs/async.md): the child killed, or frozen, with a batch in flight.
    cases += [(f"async_{signal.Signals(sig).name.lower()}@{b}", lambda b=b, sig=sig, base=None: killed_rollout_child(b, base, 1, sig))
              for b in ("fsdp", "megatron") for sig in (signal.SIGKILL, signal.SIGSTOP)]
    cases += [
              ("receiver", lambda base: transport_case("killed")), ("lost", lambda base: transport_case("lost"))]
    from fault_suite_agents import agent_cases  # env=agent (docs/agents.md)
    from fault_suite_inflight import inflight_cases  # placement.weight_update=in_flight (docs/async.md)
    from fault_suite_servers import server_cases  # rollout=server (docs/rollout-servers.md)

    cases += agent_cases()
    cases += server_cases()
    cases += inflight_cases()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rltrain-fault-suite-") as tmp:
        for name, fn in cases:
            if args.only and name not in args.only:
                continue
            row = fn(base=Path(tmp))
            rows.append(row)
            print(f"{name}: {row.outcome} ({row.seconds:.1f} s)", file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if all(r.ok and r.shm_left == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
