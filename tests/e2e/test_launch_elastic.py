"""`trainer.nproc=N` on torch's elastic agent (docs/failure-behaviour.md): the ranks are the
agent's workers with restarts off, none outlives the launcher (even a SIGKILLed one, ours or
torchrun), and Ctrl-C
stops every rank and leaves a run that the same command resumes. The failure reports (a killed
rank, a user error on rank 1) are tested in test_safety_cli.py and test_rank_errors.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli import QUICK, ROOT, SMALL_MODEL, BackgroundRun, rltrain, train_rows

pytestmark = pytest.mark.e2e

SMALL = [
    "algo=sft",
    "trainer.nproc=2",
    *SMALL_MODEL,
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=4",
    "data.num_eval=4",
    "safety.collective_timeout_s=30",
]


def rank_processes(run_dir: Path) -> dict[int, int]:
    """pid -> parent pid of every live rank of the run in `run_dir`, as `ps` lists them."""
    listing = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    ranks = {}
    for line in listing.splitlines():
        pid, ppid, args = line.split(None, 2)
        if f"-m rltrain.worker {run_dir} " in args:
            ranks[int(pid)] = int(ppid)
    return ranks


def start(args: list[str], run_dir: Path, log: Path) -> subprocess.Popen:
    """`python -m rltrain` in its own session (as from a terminal), its output to `log`."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "rltrain", *args, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(condition, what: str, proc: subprocess.Popen | BackgroundRun, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def environment(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def test_ranks_are_elastic_workers_and_die_with_a_killed_launcher(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    launcher = start([*SMALL, *QUICK, "trainer.max_steps=100000"], run_dir, tmp_path / "run.log")
    try:
        beats = [run_dir / "heartbeats" / f"rank-{r}.json" for r in (0, 1)]
        wait_for(lambda: all(b.exists() for b in beats), "heartbeat of both ranks", launcher)
        ranks = rank_processes(run_dir)
        assert len(ranks) == 2 and set(ranks.values()) == {launcher.pid}, ranks
        for pid in ranks:
            env = environment(pid)
            assert env["TORCHELASTIC_MAX_RESTARTS"] == "0" and env["TORCHELASTIC_RUN_ID"], env
        launcher.kill()  # SIGKILL: the launcher cannot forward it; the kernel must end the ranks
        launcher.wait()
        deadline = time.monotonic() + 60
        while rank_processes(run_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rank_processes(run_dir) == {}, "ranks outlived their SIGKILLed launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in rank_processes(run_dir):
            os.kill(pid, signal.SIGKILL)


def children(pid: int) -> set[int]:
    """The live child processes of `pid` (a zombie's args are its name in brackets)."""
    listing = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    rows = (line.split(None, 2) for line in listing.splitlines())
    return {int(row[0]) for row in rows if int(row[1]) == pid and "-m rltrain" in row[2]}


def alive(pids: set[int]) -> set[int]:
    listing = subprocess.run(["ps", "-ww", "-eo", "pid=,stat="], capture_output=True, text=True, check=True).stdout
    running = {int(pid) for pid, stat in (line.split() for line in listing.splitlines()) if not stat.startswith("Z")}
    return pids & running


def test_torchrun_ranks_die_with_a_killed_torchrun(tiny_cache, tmp_path):
    """Plain torchrun leaves its workers running when it is SIGKILLed; a rltrain rank asks the
    kernel to end it with its parent (rltrain.runtime.parent_death)."""
    run_dir = tmp_path / "run"
    torchrun = Path(sys.executable).parent / "torchrun"
    args = [a for a in SMALL if not a.startswith("trainer.nproc")]
    with open(tmp_path / "run.log", "w") as out:
        agent = subprocess.Popen(
            [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "rltrain", *args, *QUICK,
             "trainer.max_steps=100000", f"hydra.run.dir={run_dir}"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    ranks: set[int] = set()
    try:
        beats = [run_dir / "heartbeats" / f"rank-{r}.json" for r in (0, 1)]
        wait_for(lambda: all(b.exists() for b in beats), "heartbeat of both ranks", agent)
        ranks = children(agent.pid)
        assert len(ranks) == 2, ranks
        agent.kill()  # SIGKILL: torchrun cannot forward it
        agent.wait()
        deadline = time.monotonic() + 60
        while alive(ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive(ranks) == set(), "torchrun's ranks outlived it"
    finally:
        if agent.poll() is None:
            agent.kill()
        for pid in alive(ranks):
            os.kill(pid, signal.SIGKILL)


def test_ctrl_c_stops_every_rank_and_the_run_resumes(tiny_cache, tmp_path):
    """A warm run (tests/cli.py BackgroundRun): SIGINT to its group reaches the launcher and each
    rank, as a terminal's Ctrl-C does (the ranks' stand-ins forward it)."""
    run_dir = tmp_path / "run"
    # A run far longer than the test: however late the signal lands, it lands mid-run (a run of 6
    # or 20 steps of tens of milliseconds once finished before it did; with 100000 the test took
    # seconds longer). The resumed run goes two steps past where the stopped one got
    # (trainer.max_steps is not part of what a checkpoint pins).
    args = [*SMALL, "trainer.save_every=2", "trainer.eval_every=0", "logger.wandb.mode=disabled", "trainer.progress=lines"]
    launcher = BackgroundRun([*args, "trainer.max_steps=1000"], run_dir)
    try:
        wait_for(lambda: any((run_dir / "checkpoints").glob("step_*")), "a checkpoint", launcher)
        launcher.signal(signal.SIGINT)  # what Ctrl-C in a terminal sends to the foreground group
        proc = launcher.finish(timeout=120)
    finally:
        launcher.close()
    log = proc.stdout + proc.stderr
    assert proc.returncode == 128 + signal.SIGINT, log[-3000:]
    assert "rltrain: stopped by SIGINT; every rank was stopped" in log
    assert rank_processes(run_dir) == {}, "a rank outlived the launcher"
    assert not (run_dir / "final").exists()
    end = train_rows(run_dir)[-1]["step"] + 2
    rltrain(*args, f"trainer.max_steps={end}", run_dir=run_dir, timeout=300)
    assert [r["step"] for r in train_rows(run_dir)] == list(range(1, end + 1))
    assert (run_dir / "final" / "model.safetensors").exists()


def test_ctrl_c_stops_a_sweep_of_several_rank_jobs(tiny_cache, tmp_path):
    """A multi-rank job stopped by Ctrl-C is not a failed sweep point: the sweep stops with it,
    as a one-rank job's KeyboardInterrupt stops it, instead of starting the next job."""
    sweep = tmp_path / "sweep"
    args = ["-m", *SMALL, "trainer.seed=1,2", "trainer.max_steps=100000", "trainer.eval_every=0",
            "logger.wandb.mode=disabled", f"hydra.sweep.dir={sweep}"]
    launcher = BackgroundRun(args, tmp_path / "unused")  # a sweep writes under hydra.sweep.dir
    try:
        beats = [sweep / "0" / "heartbeats" / f"rank-{r}.json" for r in (0, 1)]
        wait_for(lambda: all(b.exists() for b in beats), "heartbeat of both ranks of job 0", launcher)
        launcher.signal(signal.SIGINT)
        proc = launcher.finish(timeout=120)
    finally:
        launcher.close()
    log = proc.stdout + proc.stderr
    assert proc.returncode == 128 + signal.SIGINT, log[-3000:]
    assert "rltrain: job 0 was stopped; the sweep stops, later jobs do not start" in log
    assert not (sweep / "1").exists(), "the sweep started its next job after Ctrl-C"
    assert rank_processes(sweep / "0") == {}
