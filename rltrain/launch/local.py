"""Local multi-rank launch (`trainer.nproc=N`) on torch's elastic agent, the engine under torchrun.

Each rank is its own process (`python -m rltrain.worker`), so it sees exactly the environment
torchrun would give it and reads its config from the run directory. `GracefulAgent` gives the
surviving ranks a grace period when one fails, so they can name the rank they lost, and a user
error is printed once. Failure and signal handling: docs/internals/launch.md.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo

from rltrain.runtime.errors import clear_reports, first_report, format_error, lost_peer_ranks

GRACE_S = 30.0
# After a rank's user error the cause is known: the peers get this long to leave by themselves.
USER_ERROR_GRACE_S = 10.0
# When the only failed ranks lost a peer (their collective failed), how long to wait for the rank
# that left first to exit too, so that it is the one named.
CAUSE_EXIT_WAIT_S = 5.0
# How long the ranks have to exit after a forwarded signal before SIGKILL (after a failed rank's
# grace period the agent's own SIGTERM-to-SIGKILL window, 30 s, applies).
SHUTDOWN_TIMEOUT_S = 10
MONITOR_INTERVAL_S = 0.2
# The agent's store: the ranks bootstrap their process group from it (torch's own default).
STORE_TIMEOUT = datetime.timedelta(seconds=600)
# The signals the agent forwards to the ranks (torch's default set).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


@dataclass
class LaunchResult:
    code: int  # 0, the first failing rank's exit code, or 128 + the signal that stopped the run
    message: str = ""  # what was printed about the failure (its first line)
    interrupted: bool = False  # stopped by a signal to the launcher (Ctrl-C, SIGTERM), not by a rank


@dataclass(frozen=True)
class RankFailure:
    rank: int
    message: str  # printed once, when the failure is first seen
    user_error: bool


def first_failure(codes: dict[int, int | None], run_dir: Path, wait_for_cause: bool = False) -> RankFailure | None:
    """The rank that caused the run to fail, given each rank's exit code (None: still running);
    None while no rank has failed, or, with `wait_for_cause`, while every failed rank only lost a
    peer and a rank is still running (the cause may be on its way out)."""
    failed = {rank: code for rank, code in codes.items() if code is not None and code != 0}
    if not failed:
        return None
    report = first_report(run_dir)
    if report is not None:
        # A rank's user error: written before that rank left its collectives, so it is the cause
        # even when a peer's exit was seen first.
        rank, paragraph = report
        return RankFailure(rank, format_error(paragraph, rank), user_error=True)
    victims = lost_peer_ranks(run_dir)
    if wait_for_cause and set(failed) <= victims and None in codes.values():
        return None
    # A rank killed by a signal is the cause; then a rank that failed by itself (not because a
    # collective failed: its peers that exited in the same poll interval were its victims).
    rank = min(failed, key=lambda r: (failed[r] >= 0, r in victims, r))
    message = f"rltrain: rank {rank} exited with code {describe_exit(failed[rank])}; stopping the other ranks"
    return RankFailure(rank, message, user_error=False)


def describe_exit(code: int) -> str:
    if code < 0:
        return f"{code} (killed by {signal.Signals(-code).name})"
    return str(code)


def shutdown_timeout_kwargs() -> dict[str, Any]:
    """`shutdown_timeout` arrived in torch 2.13's agent; on an older torch (the GPU test machine's
    image has 2.11) the ranks get the agent's fixed 30 s between SIGTERM and SIGKILL instead."""
    if "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters:
        return {"shutdown_timeout": SHUTDOWN_TIMEOUT_S}
    return {}


class GracefulAgent(LocalElasticAgent):
    """A `LocalElasticAgent` that names the first failing rank and lets its peers leave by
    themselves for a grace period before the agent terminates them."""

    def __init__(self, spec: WorkerSpec, run_dir: Path, grace_s: float) -> None:
        super().__init__(
            spec,
            logs_specs=DefaultLogsSpecs(log_dir=os.devnull),  # the ranks print to our stdout/stderr
            start_method="spawn",
            **shutdown_timeout_kwargs(),
        )
        self.run_dir = run_dir
        self.grace_s = grace_s
        self.failure: RankFailure | None = None
        self.exit_codes: dict[int, int | None] = {}
        self._failed_at = 0.0
        self._first_exit_at: float | None = None  # when a rank was first seen to have failed

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self.exit_codes = self._poll_exit_codes(worker_group)
        if self.failure is None:
            if self._first_exit_at is None and any(code not in (None, 0) for code in self.exit_codes.values()):
                self._first_exit_at = time.monotonic()
            waiting = self._first_exit_at is not None and time.monotonic() - self._first_exit_at < CAUSE_EXIT_WAIT_S
            self.failure = first_failure(self.exit_codes, self.run_dir, wait_for_cause=waiting)
            if self.failure is None and waiting:
                return RunResult(state=WorkerState.HEALTHY)  # a failed rank's peer may still be leaving
            if self.failure is not None:
                self._failed_at = time.monotonic()
                if self.failure.user_error:
                    self.grace_s = min(self.grace_s, USER_ERROR_GRACE_S)
                print(self.failure.message, file=sys.stderr, flush=True)
        still_running = any(code is None for code in self.exit_codes.values())
        if self.failure is not None and still_running and time.monotonic() - self._failed_at < self.grace_s:
            return RunResult(state=WorkerState.HEALTHY)  # the peers may still leave by themselves
        return super()._monitor_workers(worker_group)

    def _poll_exit_codes(self, worker_group: WorkerGroup) -> dict[int, int | None]:
        """Each rank's exit code (None: running), without the agent's stop-everyone reaction."""
        context = self._pcontext
        if not isinstance(context, SubprocessContext):
            raise TypeError(f"rltrain starts its ranks as subprocesses, not through {type(context).__name__}")
        return {
            worker.global_rank: context.subprocess_handlers[worker.local_rank].proc.poll()
            for worker in worker_group.workers
        }


class OneMachineRendezvous(RendezvousHandler):
    """The rendezvous of one agent with itself: a store on 127.0.0.1 at a port the OS picks, which
    the ranks share (torchrun's default `static` rendezvous, minus its fixed port). torch's c10d
    rendezvous would do the same in several rounds, each recording an event whose caller's name it
    finds by `inspect.stack()`, slow where many modules are imported (docs/internals/launch.md)."""

    def __init__(self) -> None:
        self.run_id = uuid.uuid4().hex
        self._store: TCPStore | None = None
        self._closed = False

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            self._store = TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)
        return RendezvousInfo(PrefixStore(self.run_id, self._store), 0, 1, RendezvousStoreInfo("127.0.0.1", self._store.port))

    @property
    def use_agent_store(self) -> bool:
        return True  # the ranks' process group is bootstrapped from this store

    def get_backend(self) -> str:
        return "static"

    def get_run_id(self) -> str:
        return self.run_id

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True  # the agent's word that no further round follows

    def num_nodes_waiting(self) -> int:
        return 0  # one machine: no agent ever joins later

    def shutdown(self) -> bool:
        self._store = None
        return True


def run_local(run_dir: Path, nproc: int, grace_s: float = GRACE_S) -> LaunchResult:
    """Run `nproc` ranks of the run in `run_dir`; report the first failure, if any."""
    run_dir = Path(run_dir)
    clear_reports(run_dir)
    spec = WorkerSpec(
        role="rltrain",
        local_world_size=nproc,
        entrypoint=sys.executable,
        args=("-m", "rltrain.worker", str(run_dir), str(os.getpid())),
        rdzv_handler=OneMachineRendezvous(),
        max_restarts=0,
        monitor_interval=MONITOR_INTERVAL_S,
        local_addr="127.0.0.1",
    )
    agent = GracefulAgent(spec, run_dir, grace_s)
    try:
        with quiet_elastic_logs(), restored_signal_handlers():
            result = agent.run()
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        message = f"rltrain: stopped by {name}; every rank was stopped (run the same command to resume)"
        print(message, file=sys.stderr, flush=True)
        return LaunchResult(128 + int(exc.sigval), message, interrupted=True)
    finally:
        spec.rdzv_handler.shutdown()
    if not result.is_failed():
        return LaunchResult(0)
    failure = agent.failure or first_failure(agent.exit_codes, run_dir)
    if failure is None:  # the agent failed the group without a failed rank (it lost track of one)
        return LaunchResult(1, "rltrain: the elastic agent reported the ranks as failed")
    code = result.failures[failure.rank].exitcode if failure.rank in result.failures else 1
    return LaunchResult(code if code > 0 else 1, failure.message.splitlines()[0])


@contextlib.contextmanager
def quiet_elastic_logs() -> Iterator[None]:
    """Keep torch elastic's own log lines (its ChildFailedError report, "Sending process ... closing
    signal") out of the output: the launcher prints the one line that names the failure."""
    elastic = logging.getLogger("torch.distributed.elastic")
    null = logging.NullHandler()
    previous = elastic.propagate
    elastic.addHandler(null)
    elastic.propagate = False
    try:
        yield
    finally:
        elastic.propagate = previous
        elastic.removeHandler(null)


@contextlib.contextmanager
def restored_signal_handlers() -> Iterator[None]:
    """The agent installs its forwarding handlers for the run's lifetime; put back the process's
    own afterwards (a sweep runs several jobs in this process)."""
    previous = {sig: signal.getsignal(sig) for sig in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
