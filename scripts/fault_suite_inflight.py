"""The in-flight rows of `make fault-suite` (docs/async.md, "Weights in flight"): real GRPO runs on one
trainer rank streaming with in-flight updates (`placement.weight_update=in_flight placement.stream=true`,
k = 1), over the separate engine and over vLLM API servers.

- The trainer SIGKILLed mid-stream (groups out on the engine), then the same command again: the run
  resumes from its newest checkpoint, keeps every step that checkpoint holds as it was trained
  (`batches.jsonl`), trains every prompt the checkpoint lists as submitted and not trained, and no
  prompt twice (so no token twice: a token belongs to one group of one prompt).
- One of two spawned servers SIGKILLed mid-stream: its requests go whole to the other, every step
  completes within the per-token bound, the failure counted.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from fault_suite import Row, finish, first_error, newest_checkpoint, shm_names, start, train_rows
from fault_suite_servers import MODEL, spawned_pids, wait_rows

STEPS, K, PER_STEP = 8, 1, 4
STREAM = ["algo=grpo", *MODEL, f"algo.prompts_per_step={PER_STEP}", "algo.group_size=2", "algo.max_new_tokens=24",
          "logger.wandb.mode=disabled", "trainer.eval_every=0", "trainer.save_every=1", "trainer.progress=lines",
          f"trainer.max_steps={STEPS}", f"placement.max_staleness={K}", "placement.weight_update=in_flight",
          "placement.stream=true"]
ENGINES = {"separate": ["rollout=vllm", "rollout.process=separate"], "server": ["rollout=server", "rollout.servers.spawn=1"]}


def ledger(run_dir: Path) -> list[dict]:
    path = run_dir / "batches.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def within_bound(rows: list[dict]) -> bool:
    return all(r["step"] - 1 - r["rollout/token_version_min"] <= K for r in rows)


def trainer_killed(engine: str, base: Path) -> Row:
    """Kill the trainer's whole session once step 3 is logged (step 4's groups in flight), run again."""
    run_dir, before = base / f"inflight-trainer-killed-{engine}", shm_names()
    where = f"GRPO, 1 rank, {engine}, streaming in flight, k={K}"
    args = [*STREAM, *ENGINES[engine]]
    proc = start(args, run_dir)
    if not wait_rows(run_dir, proc, 3):
        code, err = finish(proc, 60)
        return Row("trainer SIGKILL mid-stream", where, f"FAILED: no step 3 (exit {code}: {first_error(err)})", 0, "-", 0, False)
    os.killpg(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    proc.wait()
    reached, kept = len(train_rows(run_dir)), newest_checkpoint(run_dir)
    trained_before = ledger(run_dir)[:kept]
    pending = json.loads((run_dir / "checkpoints" / f"step_{kept:08d}" / "rollouts" / "rank0.json").read_text())["pending"]
    code, err = finish(start(args, run_dir), 900)
    seconds = time.monotonic() - killed
    after, rows = ledger(run_dir), train_rows(run_dir)
    prompts = [p for b in after for p in b["prompts"]]
    later = {p for b in after[kept:] for p in b["prompts"]}
    checks = {
        "all steps": [r["step"] for r in rows] == list(range(1, STEPS + 1)),
        "checkpointed steps kept": after[:kept] == trained_before,
        "pending prompts trained": {p for row in pending for p in row["global_index"]} <= later,
        "no prompt twice": len(prompts) == len(set(prompts)) == STEPS * PER_STEP,
        "bound": within_bound(rows),
    }
    ok = code == 0 and all(checks.values())
    outcome = (f"recovered on resume (checkpoint {kept} kept, steps {kept + 1}-{STEPS} trained the checkpoint's "
               f"{sum(len(r['global_index']) for r in pending)} pending prompts first, every prompt once)")
    failed = ", ".join(name for name, good in checks.items() if not good)
    return Row("trainer SIGKILL mid-stream, resumed", where, outcome if ok else f"FAILED: exit {code}: {failed} {first_error(err)}",
               seconds, str(reached - kept), len(shm_names() - before), ok)


def server_killed(base: Path) -> Row:
    """One of two spawned servers SIGKILLed once step 2 is logged: its requests go to the other."""
    run_dir, before = base / "inflight-server-killed", shm_names()
    where = f"GRPO, 1 rank, 2 spawned servers, streaming in flight, k={K}"
    proc = start([*STREAM, "rollout=server", "rollout.servers.spawn=2"], run_dir)
    if not wait_rows(run_dir, proc, 2):
        code, err = finish(proc, 60)
        return Row("rollout server SIGKILL mid-stream", where, f"FAILED: no step 2 (exit {code}: {first_error(err)})", 0, "-", 0, False)
    os.killpg(spawned_pids(proc.log_path)[1], signal.SIGKILL)  # type: ignore[attr-defined]
    killed = time.monotonic()
    code, err = finish(proc, 600)
    rows = train_rows(run_dir)
    last = rows[-1] if rows else {}
    prompts = [p for b in ledger(run_dir) for p in b["prompts"]]
    ok = (code == 0 and [r["step"] for r in rows] == list(range(1, STEPS + 1)) and within_bound(rows)
          and last.get("rollout/server_failures") == 1 and last.get("rollout/servers_up") == 1
          and len(prompts) == len(set(prompts)) == STEPS * PER_STEP)
    outcome = (f"recovered (all {len(rows)} steps within the bound, server_failures={last.get('rollout/server_failures')}, "
               f"servers_up={last.get('rollout/servers_up')}, every prompt once)")
    return Row("rollout server SIGKILL mid-stream (after step 2)", where,
               outcome if ok else f"FAILED: exit {code}: {outcome} {first_error(err)}", time.monotonic() - killed, "0",
               len(shm_names() - before), ok)


def inflight_cases() -> list[tuple[str, Callable[..., Row]]]:
    """(name, fn(base)) per row."""
    return [
        ("inflight_trainer_killed@separate", lambda base: trainer_killed("separate", base)),
        ("inflight_trainer_killed@server", lambda base: trainer_killed("server", base)),
        ("inflight_server_killed", lambda base: server_killed(base)),
    ]
