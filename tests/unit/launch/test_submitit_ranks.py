"""A submitit job's tasks agree on a rendezvous port through the job's folder, so a port another
program holds cannot stall them; a rank that does reach a listener which is not a store ends with
a paragraph instead of waiting forever (rltrain/launch/submitit_ranks.py,
rltrain/runtime/distributed.py `_rendezvous_watchdog`). The whole sweep through submitit's local
executor: tests/e2e/test_sweep_launchers.py."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys

import pytest
from helpers import rank_context

from rltrain.launch.submitit_ranks import join_submitit_ranks, port_file

JOB_ID = "424242"
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _task_env(folder, rank: int) -> dict[str, str]:
    """The variables submitit's local executor gives task `rank` of a two-task job."""
    return {
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_FOLDER": str(folder),
        "SUBMITIT_LOCAL_JOB_ID": JOB_ID,
        "SUBMITIT_LOCAL_NTASKS": "2",
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
        "SUBMITIT_LOCAL_NODEID": "0",
        "SUBMITIT_LOCAL_GLOBALID": str(rank),
        "SUBMITIT_LOCAL_LOCALID": str(rank),
    }


def _task(folder, rank: int, result_q) -> None:
    import torch
    import torch.distributed as dist

    from rltrain.runtime.distributed import init_distributed

    for key in DIST_ENV:
        os.environ.pop(key, None)
    os.environ.update(_task_env(folder, rank))
    try:
        join_submitit_ranks(timeout_s=20)
        info = init_distributed(timeout_s=20)
        total = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(total)
        result_q.put((info.rank, info.world_size, int(os.environ["MASTER_PORT"]), total.item()))
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails
        result_q.put(repr(exc))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _listener(port: int) -> socket.socket | None:
    """A plain listening socket on `port` (not a rendezvous store), or None if something else holds it."""
    sock = socket.socket()
    try:
        sock.bind(("0.0.0.0", port))
    except OSError:
        sock.close()
        return None
    sock.listen()
    return sock


def test_a_job_whose_id_derived_port_is_held_by_another_program_still_forms_its_group(tmp_path):
    # submitit's own choice for this job id: a connecting rank would wait there forever.
    derived = random.Random(JOB_ID).randint(20000, 60000)
    squatter = _listener(derived)
    ctx = rank_context()
    result_q = ctx.Queue()
    procs = [ctx.Process(target=_task, args=(tmp_path, rank, result_q), daemon=True) for rank in (1, 0)]
    try:
        for p in procs:
            p.start()
        results = sorted(result_q.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if squatter is not None:
            squatter.close()
    assert all(isinstance(r, tuple) for r in results), results
    port = int(port_file(tmp_path, JOB_ID).read_text())
    assert results == [(0, 2, port, 3.0), (1, 2, port, 3.0)]
    assert port != derived


def test_a_task_waits_for_rank_zeros_port_only_as_long_as_the_collective_timeout(tmp_path, monkeypatch):
    for key, value in _task_env(tmp_path, rank=1).items():
        monkeypatch.setenv(key, value)
    for key in DIST_ENV:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="rank 1 of this submitit job waited .* rank 0") as err:
        join_submitit_ranks(timeout_s=0.3)
    assert str(port_file(tmp_path, JOB_ID)) in str(err.value)
    assert "MASTER_PORT" not in os.environ


def test_a_user_set_master_port_is_kept(tmp_path, monkeypatch):
    for key, value in _task_env(tmp_path, rank=1).items():
        monkeypatch.setenv(key, value)
    for key in DIST_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_PORT", "29555")
    join_submitit_ranks(timeout_s=0.3)
    assert (os.environ["MASTER_PORT"], os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("29555", "1", "2")
    assert not port_file(tmp_path, JOB_ID).exists()


def test_a_rank_sent_to_a_listener_that_is_not_a_store_ends_with_a_paragraph():
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    port = squatter.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="1", WORLD_SIZE="2")
    code = "from rltrain.runtime.distributed import init_distributed; init_distributed(1.0); print('joined')"
    try:
        # torch's own timeout does not cover this case: without the watchdog the rank never returns.
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    finally:
        squatter.close()
    assert proc.returncode == 1 and "joined" not in proc.stdout
    assert f"rank 1 could not join the process group at 127.0.0.1:{port}" in proc.stderr
    assert "MASTER_PORT" in proc.stderr
