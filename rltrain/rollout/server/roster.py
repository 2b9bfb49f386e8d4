"""The fleet's servers (`rollout=server`): each entry given once, the spawned ones started, who
answers, who each one is (two URLs of one server are refused), each one joined (its weight push
opened, its model checked, the current version pushed), rank 0's list on every rank, and the
message when none answers. rltrain/rollout/server/fleet.py forms the fleet from them;
docs/rollout-servers.md ("One server, one address").
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rltrain.config.group_options import ServerRolloutConfig
from rltrain.rollout.server.client import ServerRefused, call, is_up, server_identity
from rltrain.rollout.server.process import SpawnedServer
from rltrain.rollout.server.push import WeightPusher, needs_server_device, push_backend, server_device
from rltrain.runtime.errors import UserError

ANOTHER = "(`python -m rltrain.serve --port N`)"


@dataclass
class Server:
    url: str
    spawned: SpawnedServer | None = None
    pusher: WeightPusher | None = None  # trainer rank 0 only
    up: bool = True
    outstanding: int = 0
    served: int = 0  # requests it answered
    down_since: float = 0.0
    reasons: list[str] = field(default_factory=list)
    identity: str | None = None  # the id it reports (rank 0): two URLs of one server are refused


def given_servers(urls: list[str]) -> list[Server]:
    """`rollout.servers.urls` as servers; one URL given twice is refused before anything is asked."""
    given = [url.rstrip("/") for url in urls]
    for i, url in enumerate(given):
        if url in given[:i]:
            first = given.index(url)
            raise UserError(
                f"rollout.servers.urls: entries {first} ({urls[first]}) and {i} ({urls[i]}) are the same URL: one server "
                f"takes one entry. Remove the repeat, or start another server {ANOTHER} for it."
            )
    return [Server(url) for url in given]


def spawn_servers(
    cfg: ServerRolloutConfig, model_dir: Path, dtype: str, cuda: bool, log_dir: Path,
) -> list[tuple[Server, str | None]]:
    """`rollout.servers.spawn` servers on this machine, started together; each with why it did not
    start (None: it answers)."""
    spawned = [SpawnedServer(cfg, model_dir, dtype, cuda, log_dir / f"vllm-server-{i}.log") for i in range(cfg.servers.spawn)]
    out: list[tuple[Server, str | None]] = []
    for s in spawned:
        try:
            s.wait_ready(cfg.servers.start_timeout_s)
        except RuntimeError as exc:
            print(f"rltrain: rollout server {s.url} did not start, going on without it: {exc}", flush=True)
            out.append((Server(s.url, spawned=s), str(exc)))
            continue
        print(f"rltrain: rollout server {s.url} (pid {s.proc.pid}, log {s.log_path})", flush=True)
        out.append((Server(s.url, spawned=s), None))
    return out


def not_answering(servers: list[Server], timeout_s: float) -> list[Server]:
    """The `servers` that did not answer /health within `timeout_s` (waited for all together)."""
    deadline = time.monotonic() + timeout_s
    waiting = list(servers)
    while waiting:
        waiting = [s for s in waiting if not is_up(s.url)]
        if not waiting or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    return waiting


def identify(server: Server, timeout_s: float) -> None:
    """Ask `server` who it is (the id its worker extension reports)."""
    try:
        server.identity = server_identity(server.url, timeout_s)
    except ServerRefused as exc:
        raise UserError(
            f"rollout=server: {server.url} answers, but not as a server of rltrain's (no dev-mode /collective_rpc "
            f"or no worker extension: {str(exc)[:200]}). Start it with `python -m rltrain.serve <the run's overrides>`."
        ) from None


def refuse_duplicates(servers: list[Server]) -> None:
    """Two entries that reach one server (one URL twice, two names of one host) are refused: the
    trainer would push each version into it twice over two pair groups."""
    seen: dict[str, Server] = {}
    for server in servers:
        if server.identity is None:
            continue
        first = seen.setdefault(server.identity, server)
        if first is not server:
            raise UserError(
                f"rollout.servers.urls: {first.url} and {server.url} reach the same server (it reports one id, "
                f"{server.identity}). Give each server once; for a second server start another {ANOTHER}."
            )


def join(
    server: Server, cfg: ServerRolloutConfig, model_dir: Path, cuda_device: torch.device | None,
    expected: dict[str, str], buckets: list[tuple[torch.Tensor, list[list[Any]]]], version: int,
) -> None:
    """Rank 0: open the weight push to `server`, refuse another model than the one in `model_dir`
    (whose `model_fingerprint` is `expected`), reset it to `buckets` at `version`: the checkpoint (a
    server may hold an earlier run's weights) or the current version."""
    server.pusher = WeightPusher(
        server.url, cfg.servers.trainer_address, cfg.timeout_s, server_push_backend(server, cfg, cuda_device is not None), cuda_device
    )
    answer = server.pusher.join()
    got = answer["fingerprint"]
    differ = [name for name in expected if got.get(name) != expected[name]]
    if differ:
        raise UserError(
            f"rollout=server: {server.url} serves another model than the trainer's {model_dir}: its "
            f"{', '.join(differ)} differ{'s' if len(differ) == 1 else ''}. Start that server on the same model "
            "directory (`python -m rltrain.serve` with the run's model overrides) or remove it from rollout.servers.urls."
        )
    # A trainer killed between an in-flight push's pause and resume (push.py) leaves the server
    # holding its requests, and every later one with them; resuming a server that runs is a no-op.
    call(server.url, "/resume", {}, cfg.timeout_s)
    server.pusher.push(buckets, version)


def server_push_backend(server: Server, cfg: ServerRolloutConfig, cuda: bool) -> str:
    """gloo or NCCL for this server (`rollout.servers.push_backend`) from a trainer on CUDA or not;
    the server's device is asked only where NCCL is possible."""
    setting, spawned = cfg.servers.push_backend, server.spawned is not None
    device = server_device(server.url, cfg.timeout_s) if needs_server_device(setting, cuda, spawned) else None
    return push_backend(setting, trainer_cuda=cuda, server_device=device, spawned=spawned, url=server.url)


def all_down_message(servers: list[Server], timeout_s: float) -> str:
    """Why the run stops when no server answered for `rollout.timeout_s`: each server's last reason."""
    names = "; ".join(f"{s.url} ({(s.reasons or ['no answer'])[-1][:200]})" for s in servers)
    return (
        f"rollout=server: every rollout server stayed unreachable for rollout.timeout_s={timeout_s:g}s: {names}. "
        "Restart them (`python -m rltrain.serve <the run's overrides>` for a URL-given one; a spawned one's log is in the "
        "run directory) or raise rollout.timeout_s; the run resumes from its last checkpoint."
    )


def share_urls(urls: list[str]) -> list[str]:
    """Rank 0's server list on every rank (a JSON byte tensor broadcast, no pickle)."""
    import torch.distributed as dist

    payload = torch.tensor(list(json.dumps(urls).encode()), dtype=torch.uint8, device="cpu")
    size = torch.tensor([payload.numel()], dtype=torch.int64, device="cpu")
    dist.broadcast(size, 0)
    buf = payload if dist.get_rank() == 0 else torch.empty(int(size.item()), dtype=torch.uint8, device="cpu")
    dist.broadcast(buf, 0)
    return list(json.loads(bytes(buf.tolist()).decode()))
