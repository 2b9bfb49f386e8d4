"""The weight push's backend per server and its concurrency (rltrain/rollout/server/push.py,
docs/rollout-servers.md): `rollout.servers.push_backend` picks NCCL only where both ends run on
CUDA and the server is not one the trainer spawned on its own GPU; the fleet pushes to every
server at once and a failed push is that server's alone."""

from __future__ import annotations

import threading

import pytest

from rltrain.rollout.server.client import ServerDown
from rltrain.rollout.server.push import needs_server_device, push_backend, run_each
from rltrain.runtime.errors import UserError

URL = "http://nodeB:8000"


@pytest.mark.parametrize(
    ("setting", "trainer_cuda", "server_device", "spawned", "expected"),
    [
        ("auto", True, "cuda", False, "nccl"),  # a GPU trainer and a GPU server elsewhere
        ("auto", True, "cuda", True, "gloo"),  # spawned: it shares the trainer's GPU, NCCL refuses
        ("auto", True, "cpu", False, "gloo"),  # a CPU server
        ("auto", False, None, False, "gloo"),  # a CPU trainer: the server is not asked
        ("auto", False, "cuda", False, "gloo"),
        ("gloo", True, "cuda", False, "gloo"),  # asked for: gloo even between GPUs
        ("gloo", False, None, True, "gloo"),
        ("nccl", True, "cuda", False, "nccl"),
        ("nccl", True, "cuda", True, "nccl"),  # asked for on a spawned server: tried (fails at join on one GPU)
    ],
)
def test_the_backend_chosen(setting, trainer_cuda, server_device, spawned, expected):
    assert push_backend(setting, trainer_cuda=trainer_cuda, server_device=server_device, spawned=spawned, url=URL) == expected


@pytest.mark.parametrize(
    ("trainer_cuda", "server_device", "where"),
    [(False, None, "the trainer runs on the CPU"), (False, "cuda", "the trainer runs on the CPU"),
     (True, "cpu", f"{URL} runs its model on cpu")],
)
def test_nccl_without_a_gpu_at_both_ends_is_refused_naming_the_server_and_the_fix(trainer_cuda, server_device, where):
    with pytest.raises(UserError) as info:
        push_backend("nccl", trainer_cuda=trainer_cuda, server_device=server_device, spawned=False, url=URL)
    message = str(info.value)
    assert URL in message and where in message and "rollout.servers.push_backend=gloo" in message


def test_another_setting_is_refused():
    with pytest.raises(UserError, match="push_backend='mpi' is not one of auto, gloo, nccl"):
        push_backend("mpi", trainer_cuda=True, server_device="cuda", spawned=False, url=URL)


@pytest.mark.parametrize(
    ("setting", "trainer_cuda", "spawned", "asks"),
    [
        ("auto", True, False, True),
        ("auto", True, True, False),  # spawned: gloo whatever its device
        ("auto", False, False, False),  # a CPU trainer's join makes no extra call
        ("gloo", True, False, False),
        ("nccl", True, True, True),
        ("nccl", False, False, False),  # refused before asking
    ],
)
def test_the_server_is_asked_its_device_only_where_nccl_is_possible(setting, trainer_cuda, spawned, asks):
    assert needs_server_device(setting, trainer_cuda, spawned) is asks


def test_pushes_run_at_once_and_a_failure_is_that_server_s_alone():
    """Three jobs meet at a barrier that only concurrent jobs pass; the second fails as a server
    push fails, and the others still finish."""
    barrier = threading.Barrier(3, timeout=10)
    done: list[int] = []

    def job(i: int) -> None:
        barrier.wait()
        if i == 1:
            raise ServerDown(f"server {i} did not answer")
        done.append(i)

    errors = run_each([lambda i=i: job(i) for i in range(3)])
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], ServerDown) and "server 1" in str(errors[1])
    assert sorted(done) == [0, 2]


def test_a_single_push_runs_on_the_caller_s_thread():
    seen: list[threading.Thread] = []
    assert run_each([lambda: seen.append(threading.current_thread())]) == [None]
    assert seen == [threading.current_thread()]
    assert run_each([]) == []
