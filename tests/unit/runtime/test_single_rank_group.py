"""A single local rank (no launcher, no MASTER_ADDR) forms its own process group on a port that its
store holds from the moment the port is chosen: another process cannot take it in between (a sweep
starts many single-rank jobs at once). rltrain/runtime/distributed.py `_single_rank_store`."""

from __future__ import annotations

import os
import socket

from helpers import rank_context

LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _single_rank(result_q) -> None:
    """Join as a single rank while a thief tries to bind the announced port just before the group
    forms (where a port chosen free and bound later would be lost); report what each saw."""
    import torch
    import torch.distributed as dist

    from rltrain.runtime import distributed

    for key in LAUNCHER_ENV:
        os.environ.pop(key, None)
    stolen: list[bool] = []
    real_init = dist.init_process_group

    def init_after_a_theft_attempt(*args, **kwargs):
        thief = socket.socket()
        try:
            thief.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
            stolen.append(True)
        except OSError:
            stolen.append(False)
        finally:
            thief.close()
        return real_init(*args, **kwargs)

    dist.init_process_group = init_after_a_theft_attempt
    try:
        info = distributed.init_distributed(timeout_s=20)
        total = torch.ones(3)
        dist.all_reduce(total)
        result_q.put((info.rank, info.world_size, stolen, int(os.environ["MASTER_PORT"]), total.tolist()))
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails
        result_q.put(repr(exc))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_single_ranks_started_together_each_hold_their_own_port():
    ctx = rank_context()
    result_q = ctx.Queue()
    procs = [ctx.Process(target=_single_rank, args=(result_q,), daemon=True) for _ in range(2)]
    for p in procs:
        p.start()
    results = [result_q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    assert all(isinstance(r, tuple) for r in results), results
    for rank, world, stolen, _, total in results:
        assert (rank, world) == (0, 1)
        assert stolen == [False], "the announced port was free before the group formed"
        assert total == [1.0, 1.0, 1.0]
    assert results[0][3] != results[1][3]
