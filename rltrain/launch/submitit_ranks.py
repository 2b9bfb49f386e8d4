"""A submitit job of several tasks (Slurm's `nodes` x `tasks_per_node`, or submitit_local's
`tasks_per_node`) trains as one torch.distributed run, each task one rank with the variables
torchrun would give it. The port is what the tasks must agree on without a channel: submitit's
helper derives it from the job id, a fixed port another program may listen on, where a
connecting rank waits forever. So rank 0 hosts the store on a port the kernel picks and writes it
to a file in the job's submitit folder (shared by the job's nodes, as submitit requires); the
other tasks read it. A MASTER_PORT the user set is used as it is. docs/launching.md (Slurm).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from rltrain.runtime.distributed import host_rendezvous_store

_POLL_S = 0.1


def join_submitit_ranks(timeout_s: float) -> None:
    """Export the torchrun variables for this task when it is one of several in a submitit job
    (a one-task job, or a process outside submitit, is left as it is). Rank 0 starts the job's
    rendezvous store here; the other tasks wait at most `timeout_s` for its port."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return
    import submitit

    job = submitit.JobEnvironment()
    if job.num_tasks <= 1:
        return
    if "MASTER_PORT" in os.environ:
        port = int(os.environ["MASTER_PORT"])
    elif job.global_rank == 0:
        port = host_rendezvous_store(job.num_tasks, timeout_s)
        _write_port(port_file(job.paths.folder, job.job_id), port)
    else:
        port = _read_port(port_file(job.paths.folder, job.job_id), job.global_rank, timeout_s)
    os.environ.update(
        MASTER_ADDR=job.hostnames[0],
        MASTER_PORT=str(port),
        RANK=str(job.global_rank),
        WORLD_SIZE=str(job.num_tasks),
        LOCAL_RANK=str(job.local_rank),
        LOCAL_WORLD_SIZE=str(job.num_tasks // job.num_nodes),
    )


def port_file(folder: Path, job_id: str) -> Path:
    """Where rank 0 writes the port: one file per job and per start of it (a requeued Slurm job
    keeps its id; SLURM_RESTART_COUNT tells its starts apart, so no task reads a dead start's port)."""
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
    return Path(folder) / f"{job_id}_rendezvous_port_{attempt}"


def _write_port(path: Path, port: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(port))
    tmp.replace(path)  # whole or absent: a reader never sees half a number


def _read_port(path: Path, rank: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rank {rank} of this submitit job waited {timeout_s:.0f} s (safety.collective_timeout_s) for rank 0 "
                f"to write its rendezvous port to {path}, and it did not: rank 0 did not start or failed first "
                "(its log is beside that file, *_0_log.err), or the folder is not shared between the job's nodes"
            )
        time.sleep(_POLL_S)
    return int(path.read_text())
