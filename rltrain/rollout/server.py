"""`rollout=server`: the rollout engine is a fleet of vLLM's own API servers reached over HTTP.

Each prompt (a GRPO group: its `n` samples) is one request to one server (its prefix cache),
chosen client-side by least outstanding requests, and seeded by its index in the batch, so a
completion does not depend on which server produced it. Trainer rank 0 pushes every new version
to every server at once (rltrain/rollout/server_push.py: gloo, or NCCL between GPUs) and keeps it
as a host copy, so a server that comes back gets the current weights before it serves again.
Every completion carries the vLLM weight version that sampled it; one from another version than
the engine's stops the run. docs/rollout-servers.md.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rltrain.config.group_options import ServerRolloutConfig
from rltrain.rollout.base import Completion, SamplingSettings
from rltrain.rollout.images import PromptImages, check_batch
from rltrain.rollout.server_http import ServerDown, call, is_up
from rltrain.rollout.server_images import answered_prompt, generate_fields, model_image_token
from rltrain.rollout.server_process import SpawnedServer, stop_servers
from rltrain.rollout.server_push import (
    WeightPusher,
    buckets_of,
    needs_server_device,
    push_backend,
    run_each,
    server_device,
)
from rltrain.rollout.server_worker import model_fingerprint
from rltrain.rollout.vllm import _request_seed
from rltrain.runtime.errors import UserError

MAX_IN_FLIGHT = 64  # concurrent requests from one trainer rank


class FleetDown(RuntimeError):
    """Every server stayed unreachable for `rollout.timeout_s`."""


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


class ServerFleetEngine:
    """`RolloutEngine` over vLLM API servers (see the module doc)."""

    weights_survive_sleep = True  # the servers never sleep: time sharing is refused with rollout=server

    def __init__(
        self, cfg: ServerRolloutConfig, model_dir: str | Path, *, dtype: str, rank: int, cuda: bool,
        log_dir: Path, urls_from_rank0: Any = None, loads_group: Any = None,
    ) -> None:
        self.cfg = cfg
        # Generating ahead on several trainer ranks: a process group of the engine's worker threads,
        # so that no rank's push of a version lands while another rank still samples the batch of an
        # earlier one on the same servers (`update_weights`).
        self.loads_group = loads_group
        self.rank = rank
        self.cuda = cuda
        # The trainer's GPU, taken here on the main thread: NCCL pushes run on threads of their own.
        self.cuda_device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
        self.model_dir = Path(model_dir)
        self.image_token = model_image_token(self.model_dir)  # None: a text-only model
        self.version = 0
        self.failures = 0
        self.observed: list[int] = []  # versions of the completions since the last `metrics()`
        self.current: list[tuple[torch.Tensor, list[list[Any]]]] | None = None  # rank 0: the pushed version
        self._lock = threading.Lock()
        self.servers: list[Server] = []
        try:
            if rank == 0:
                self.servers = [Server(url.rstrip("/")) for url in cfg.servers.urls]
                spawned = [
                    SpawnedServer(cfg, model_dir, dtype, cuda, log_dir / f"vllm-server-{i}.log") for i in range(cfg.servers.spawn)
                ]
                self.servers += [Server(s.url, spawned=s) for s in spawned]
                for s in spawned:
                    s.wait_ready(cfg.servers.start_timeout_s)
                    print(f"rltrain: rollout server {s.url} (pid {s.proc.pid}, log {s.log_path})", flush=True)
            urls = [s.url for s in self.servers]
            if urls_from_rank0 is not None:  # every rank uses the servers rank 0 spawned
                urls = urls_from_rank0(urls)
                if rank != 0:
                    self.servers = [Server(u) for u in urls]
            if not self.servers:
                raise UserError(
                    "rollout=server has no servers: set rollout.servers.spawn=N (servers started on this machine) "
                    "and/or rollout.servers.urls=[http://host:port,...] (servers started with `python -m rltrain.serve`)."
                )
            for server in self.servers:
                self._wait_up(server, cfg.servers.start_timeout_s)
            if rank == 0:
                expected, buckets = model_fingerprint(self.model_dir), self._current_buckets()
                errors = run_each([partial(self._join, server, expected, buckets) for server in self.servers])
                for error in errors:
                    if error is not None:
                        raise error
        except BaseException:
            self.close()
            raise

    # --- servers --------------------------------------------------------------------------------

    def _wait_up(self, server: Server, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not is_up(server.url):
            if time.monotonic() > deadline:
                raise FleetDown(
                    f"rollout=server: {server.url} did not answer /health within {timeout_s:g}s. Start it "
                    "(`python -m rltrain.serve <the run's overrides>`) or fix rollout.servers.urls."
                )
            time.sleep(1.0)

    def _current_buckets(self) -> list[tuple[torch.Tensor, list[list[Any]]]]:
        """The version servers that (re)join get: the pushed one, else the checkpoint (version 0),
        read once for all the servers that join together."""
        if self.current is not None:
            return self.current
        return list(buckets_of(_checkpoint(self.model_dir), self.cfg.bucket_mb << 20))

    def _join(self, server: Server, expected: dict[str, str], buckets: list[tuple[torch.Tensor, list[list[Any]]]]) -> None:
        """Rank 0: open the weight push to `server`, refuse another model, reset it to `buckets`:
        the checkpoint (a server may hold an earlier run's weights) or the current version."""
        server.pusher = WeightPusher(
            server.url, self.cfg.servers.trainer_address, self.cfg.timeout_s, self._push_backend(server), self.cuda_device
        )
        answer = server.pusher.join()
        got = answer["fingerprint"]
        differ = [name for name in expected if got.get(name) != expected[name]]
        if differ:
            raise UserError(
                f"rollout=server: {server.url} serves another model than the trainer's {self.model_dir}: its "
                f"{', '.join(differ)} differ{'s' if len(differ) == 1 else ''}. Start that server on the same model "
                "directory (`python -m rltrain.serve` with the run's model overrides) or remove it from rollout.servers.urls."
            )
        server.pusher.push(buckets, self.version)

    def _push_backend(self, server: Server) -> str:
        """gloo or NCCL for this server (`rollout.servers.push_backend`); the server's device is asked
        only where NCCL is possible."""
        setting, spawned = self.cfg.servers.push_backend, server.spawned is not None
        device = server_device(server.url, self.cfg.timeout_s) if needs_server_device(setting, self.cuda, spawned) else None
        return push_backend(setting, trainer_cuda=self.cuda, server_device=device, spawned=spawned, url=server.url)

    def _mark_down(self, server: Server, reason: str) -> None:
        with self._lock:
            if server.up:
                server.up = False
                server.down_since = time.monotonic()
                self.failures += 1
            server.reasons.append(reason)

    def _revive(self) -> None:
        """Down servers that answer again: rank 0 re-joins them and pushes the current version
        before they serve (several at once); other ranks take them back once they report that version."""
        back = [server for server in self.servers if not server.up and is_up(server.url)]
        if self.rank != 0:
            for server in back:
                try:
                    server.up = self._server_version(server) == self.version
                except ServerDown as exc:
                    server.reasons.append(str(exc))
            return
        if not back:
            return
        expected, buckets = model_fingerprint(self.model_dir), self._current_buckets()
        errors = run_each([partial(self._join, server, expected, buckets) for server in back])
        for server, error in zip(back, errors, strict=True):
            if isinstance(error, ServerDown):
                server.reasons.append(str(error))
            elif error is not None:
                raise error
            else:
                server.up = True

    def _server_version(self, server: Server) -> int:
        answer = call(server.url, "/weight_info", None, self.cfg.timeout_s)
        try:
            return int(answer["weight_version"])
        except (TypeError, ValueError):
            return -1

    def _pick(self, deadline: float) -> Server:
        while True:
            with self._lock:
                up = [s for s in self.servers if s.up]
                if up:
                    server = min(up, key=lambda s: s.outstanding)
                    server.outstanding += 1
                    return server
            if time.monotonic() > deadline:
                raise FleetDown(self._all_down_message())
            time.sleep(1.0)
            with self._lock:
                self._revive()

    def _all_down_message(self) -> str:
        names = "; ".join(f"{s.url} ({(s.reasons or ['no answer'])[-1][:200]})" for s in self.servers)
        return (
            f"rollout=server: every rollout server stayed unreachable for rollout.timeout_s={self.cfg.timeout_s:g}s: {names}. "
            "Restart them (`python -m rltrain.serve <the run's overrides>` for a URL-given one; a spawned one's log is in the "
            "run directory) or raise rollout.timeout_s; the run resumes from its last checkpoint."
        )

    # --- RolloutEngine --------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], sampling: SamplingSettings, images: list[PromptImages] | None = None
    ) -> list[Completion]:
        check_batch(prompts, images)
        with self._lock:
            self._revive()
        if self.rank != 0:  # rank 0's push may still be under way: wait for the version
            self._await_version()
        deadline = time.monotonic() + self.cfg.timeout_s
        with ThreadPoolExecutor(max_workers=max(1, min(len(prompts), MAX_IN_FLIGHT))) as pool:
            results = list(pool.map(
                lambda i: self._request(i, prompts[i], sampling, deadline, images[i] if images else None), range(len(prompts))
            ))
        return [c for group in results for c in group]

    def _await_version(self) -> None:
        deadline = time.monotonic() + self.cfg.timeout_s
        for server in self.servers:
            while server.up:
                try:
                    if self._server_version(server) >= self.version:
                        break
                except ServerDown as exc:
                    self._mark_down(server, str(exc))
                    break
                if time.monotonic() > deadline:
                    self._mark_down(server, f"still not at version {self.version} after {self.cfg.timeout_s:g}s")
                    break
                time.sleep(0.05)

    def _request(
        self, index: int, prompt: list[int], sampling: SamplingSettings, deadline: float, images: PromptImages | None
    ) -> list[Completion]:
        body = {
            **generate_fields(index, prompt, images, self.image_token),  # images: rollout/server_images.py
            "sampling_params": {
                "n": sampling.n, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "max_tokens": sampling.max_new_tokens, "seed": _request_seed(sampling.seed, index, sampling.n),
                "stop_token_ids": sorted(set(sampling.stop_token_ids)) or None,
                "logprobs": 0, "detokenize": False,
            },
        }
        while True:
            server = self._pick(deadline)
            try:
                answer = call(server.url, "/inference/v1/generate", body, self.cfg.timeout_s)
            except ServerDown as exc:
                self._mark_down(server, str(exc))
                continue
            finally:
                with self._lock:
                    server.outstanding -= 1
            server.served += 1
            return self._completions(index, answer, server, answered_prompt(index, prompt, answer, self.image_token))

    def _completions(
        self, index: int, answer: dict[str, Any], server: Server, prompt_ids: list[int] | None = None
    ) -> list[Completion]:
        out = []
        for choice in sorted(answer["choices"], key=lambda c: c["index"]):
            versions = {span["version"] for span in choice.get("weight_versions") or []}
            if versions != {str(self.version)}:
                raise UserError(
                    f"rollout=server: {server.url} sampled a completion with weight version {sorted(versions)} where the "
                    f"schedule names version {self.version}: another trainer pushes weights into it, or it restarted "
                    "without them. Give each run its own servers (rollout.servers.urls)."
                )
            with self._lock:
                self.observed.append(self.version)
            token_ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(entry["logprob"]) for entry in choice["logprobs"]["content"]]
            out.append(Completion(
                index, token_ids, logprobs, finished=choice["finish_reason"] == "stop", prompt_ids=prompt_ids,
                version=int(versions.pop()),
            ))
        return out

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Rank 0 pushes the version to every server that is up, all at once (a failed push marks
        that server down; it gets this version when it comes back); other ranks count the version."""
        self.version += 1
        if self.rank != 0:
            deque(weights, maxlen=0)  # the export is a collective: every rank consumes it
            self._every_rank_loads()
            return
        self.current = list(buckets_of(weights, self.cfg.bucket_mb << 20))
        self._every_rank_loads()
        targets = [(server, server.pusher) for server in self.servers if server.up and server.pusher is not None]
        errors = run_each([partial(pusher.push, self.current, self.version) for _, pusher in targets])
        for (server, _), error in zip(targets, errors, strict=True):
            if isinstance(error, ServerDown):
                self._mark_down(server, str(error))
        for error in errors:
            if error is not None and not isinstance(error, ServerDown):
                raise error

    def _every_rank_loads(self) -> None:
        """Generating ahead, each rank's load of a version runs on its engine's worker thread after
        the batches queued before it: a barrier of those threads holds rank 0's push until every
        rank sampled its batches of the earlier version (a multi-turn batch may take a whole step)."""
        if self.loads_group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.loads_group)

    def metrics(self) -> dict[str, float]:
        """The fleet now, and the versions of the completions sampled since the last call (a
        multi-turn episode's completion is assembled from several; a single-turn batch generated
        ahead is measured from its own completions instead: rltrain/algos/rl.py)."""
        with self._lock:
            observed, self.observed = self.observed, []
        return {
            # Nothing sampled here (a model-parallel replica's follower): neutral for the reduction.
            "rollout/version_min": float(min(observed, default=float("inf"))),
            "rollout/version_max": float(max(observed, default=float("-inf"))),
            "rollout/servers_up": float(sum(s.up for s in self.servers)),
            "rollout/server_failures": float(self.failures),
        }

    def sleep(self) -> None:
        raise RuntimeError("rollout=server never sleeps: time sharing is refused for it at config time")

    def wake(self) -> None:
        raise RuntimeError("rollout=server never sleeps: time sharing is refused for it at config time")

    def ping(self) -> bool:
        """True when at least one server answers `/health`."""
        if not any(is_up(s.url) for s in self.servers):
            raise FleetDown(self._all_down_message())
        return True

    def close(self) -> None:
        """Stop the servers this trainer spawned; URL-given servers are never stopped."""
        stop_servers([server.spawned for server in self.servers if server.spawned is not None])
        for server in self.servers:
            server.spawned = None


def _checkpoint(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file), device="cpu"))
    return sorted(tensors.items())


def _share_urls(urls: list[str]) -> list[str]:
    """Rank 0's server list on every rank (a JSON byte tensor broadcast, no pickle)."""
    import torch.distributed as dist

    payload = torch.tensor(list(json.dumps(urls).encode()), dtype=torch.uint8, device="cpu")
    size = torch.tensor([payload.numel()], dtype=torch.int64, device="cpu")
    dist.broadcast(size, 0)
    buf = payload if dist.get_rank() == 0 else torch.empty(int(size.item()), dtype=torch.uint8, device="cpu")
    dist.broadcast(buf, 0)
    return list(json.loads(bytes(buf.tolist()).decode()))


def build_engine(ctx: Any) -> ServerFleetEngine:
    """The run's fleet (registry key `server`)."""
    import torch.distributed as dist

    from rltrain.runtime.precision import resolve_precision

    cfg: ServerRolloutConfig = ctx.cfg.rollout
    several = dist.is_initialized() and dist.get_world_size() > 1
    share = _share_urls if several else None
    loads_group = None
    if several and ctx.cfg.placement.max_staleness >= 1:  # every rank builds the engine: new_group is collective
        loads_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=ctx.cfg.safety.collective_timeout_s))
    return ServerFleetEngine(
        cfg, ctx.model_dir, dtype=resolve_precision(ctx.cfg.trainer.precision, ctx.dist.device).compute_dtype_name,
        rank=ctx.dist.rank, cuda=ctx.dist.device.type == "cuda", log_dir=Path(ctx.run_dir), urls_from_rank0=share,
        loads_group=loads_group,
    )
