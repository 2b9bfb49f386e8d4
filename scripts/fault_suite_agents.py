"""The `env=agent` rows of `make fault-suite` (docs/agents.md, "Isolation"): agents that block on one
prompt in eight, each its own way (their event loop with a synchronous sleep inside `async def`,
their thread, the CPU, an await that never returns). Real GRPO runs on one rank with the HF
engine, 16 episodes a step on one worker, all in flight at once: the blocked episodes (the agent
logs each) must be exactly `env/timeouts`, every other episode must count as it would without
them (`env/errors` 0), and the run must complete its steps.
"""

from __future__ import annotations

import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from fault_suite import Row, finish, first_error, read_metrics, shm_names, start, train_rows

STEPS = 2
TIMEOUT_S = 6.0  # env.timeout_s
EVAL_ROWS = 16
RUN = ["algo=grpo", "model=tiny", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
       "model.intermediate_size=128", "rollout=hf", "env=agent", "env.workers=1", "env.max_concurrency=16",
       f"env.timeout_s={TIMEOUT_S:g}", "algo.prompts_per_step=8", "algo.group_size=2", f"data.num_eval={EVAL_ROWS}", "reward.max_failure_frac=0.5",
       f"trainer.max_steps={STEPS}", "trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=lines",
       "logger.wandb.mode=disabled"]
AGENTS = textwrap.dedent('''
    import asyncio, os, time, zlib

    def blocked(row):
        """One prompt in eight (by its text's checksum) blocks; each blocked episode leaves a line."""
        if zlib.crc32(row["prompt"].encode()) % 8:
            return False
        with open(os.environ["FAULT_AGENT_LOG"], "a") as log:
            log.write(row["prompt"] + "\\n")
        return True

    def ask(client, row):
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=4)
        return 1.0

    async def ask_async(client, row):
        await asyncio.sleep(0.2)
        await client.chat.completions.create(model="x", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=4)
        return 1.0

    async def loop_sleep(client, row):
        if blocked(row):
            time.sleep(1000)  # a synchronous sleep inside async def: the worker's event loop stops
        return await ask_async(client, row)

    async def never_returns(client, row):
        if blocked(row):
            await asyncio.Event().wait()
        return await ask_async(client, row)

    async def spins(client, row):
        if blocked(row):
            while True:
                pass
        return await ask_async(client, row)

    def thread_sleep(client, row):
        if blocked(row):
            time.sleep(1000)
        time.sleep(0.2)
        return ask(client, row)
''')
CASES = {
    "agent_loop_sleep": ("loop_sleep", "async def agent: time.sleep on its event loop, 1 prompt in 8"),
    "agent_spins": ("spins", "async def agent: CPU spin on its event loop, 1 prompt in 8"),
    "agent_never_returns": ("never_returns", "async def agent: an await that never returns, 1 prompt in 8"),
    "agent_thread_sleep": ("thread_sleep", "synchronous agent: time.sleep in its thread, 1 prompt in 8"),
}


def agent_case(name: str, base: Path) -> Row:
    function, fault = CASES[name]
    folder = Path(tempfile.mkdtemp(prefix="agents", dir=base))
    (folder / "fault_agents.py").write_text(AGENTS)
    log = folder / "blocked.log"
    run_dir = base / name
    before = shm_names()
    t0 = time.monotonic()
    proc = start([*RUN, f"env.agent=fault_agents:{function}"], run_dir,
                 env={"PYTHONPATH": str(folder), "FAULT_AGENT_LOG": str(log)})
    code, err = finish(proc, 600)
    seconds = time.monotonic() - t0
    rows = train_rows(run_dir)
    blocked = len(log.read_text().splitlines()) if log.exists() else 0
    timeouts = sum(r.get("env/timeouts", 0.0) for r in rows)
    errors = sum(r.get("env/errors", 0.0) for r in rows)
    # The final evaluation's episodes (one per eval row, greedy) block too; every other one succeeds.
    evals = [r for r in read_metrics(run_dir) if "eval/success" in r]
    eval_failed = round((1.0 - evals[-1]["eval/success"]) * EVAL_ROWS) if evals else 0
    ok = code == 0 and len(rows) == STEPS and blocked > 0 and timeouts + eval_failed == blocked and errors == 0
    outcome = (f"recovered (env/timeouts={timeouts:g}, eval failures {eval_failed}: the {blocked} blocked episodes; "
               f"env/errors={errors:g})" if code == 0 else f"exit {code}: {first_error(err)}")
    return Row(fault, "GRPO env=agent, 1 rank, 1 worker, 16 episodes at once", outcome if ok else f"FAILED: {outcome}",
               seconds, "0" if code == 0 else "-", len(shm_names() - before), ok)


def agent_cases() -> list[tuple[str, Callable[..., Row]]]:
    return [(name, lambda base, name=name: agent_case(name, base)) for name in CASES]
