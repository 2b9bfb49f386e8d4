"""The trainer's end inside a vLLM API server: a worker extension (`--worker-extension-cls
rltrain.rollout.server.extension.WeightPushExtension`) that vLLM mixes into its worker class.

vLLM 0.32's own weight-transfer engines need CUDA; this path also runs on the CPU build. The trainer
calls it through vLLM's `/collective_rpc` (JSON strings only): `rltrain_server_id`, `rltrain_device`,
`rltrain_join` (a two-member gloo or NCCL group with the trainer), `rltrain_receive` (one version's
buckets, raw bytes, loaded in place), and on the CPU build `rltrain_take_routing` (a MoE's routers
are tapped for router replay from the first join on). docs/rollout-servers.md; docs/moe.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from rltrain.transport.buckets import DTYPES

FINGERPRINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
SERVER_ID_ENV = "RLTRAIN_SERVER_ID"
# The server's identity: what `python -m rltrain.serve` (or a trainer spawning it) put in its
# environment, else one of its own (a server started by hand with this extension).
SERVER_ID = os.environ.get(SERVER_ID_ENV) or uuid.uuid4().hex


def model_fingerprint(model_dir: str | Path) -> dict[str, str]:
    """What must match between the trainer and a server: a digest per file that defines the
    model's shapes and its tokens (file missing: "absent")."""
    out: dict[str, str] = {}
    for name in FINGERPRINT_FILES:
        path = Path(model_dir) / name
        out[name] = hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else "absent"
    return out


def pair_store(host: str, port: int, rank: int, timeout_s: float) -> Any:
    """The store of a pair group: rank 0 (the trainer) hosts it, on a port the kernel picks when
    `port` is 0 (read back as `.port`: no moment in which another program could take it); rank 1
    (the server's worker) connects to it."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, 2, rank == 0, timedelta(seconds=timeout_s), wait_for_workers=False)


def open_pair_group(store: Any, rank: int, backend: str, timeout_s: float) -> Any:
    """A two-member process group outside the default one (the trainer has its own world), over
    `store` (`pair_store`): rank 0 is the trainer, rank 1 the server's worker."""
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(store, rank, 2, options)


def unpack_bucket(bucket_u8: torch.Tensor, entries: list[list[Any]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of one received bucket: `entries` rows are [name, dtype, shape, byte offset]."""
    out = []
    for name, dtype_name, shape, offset in entries:
        dtype = DTYPES[dtype_name]
        nbytes = math.prod(int(d) for d in shape) * dtype.itemsize
        raw = bucket_u8[int(offset): int(offset) + nbytes]
        out.append((name, raw.view(dtype).reshape([int(d) for d in shape])))
    return out


class WeightPushExtension:
    """Mixed into vLLM's worker: `self` is the worker (its `model_runner`, `device`)."""

    rltrain_group: Any = None
    rltrain_version: int = 0
    # The fast plan per set of pushed names (None: it does not apply), built on the first push as
    # the in-process engine builds its own once: every version after reuses it.
    rltrain_plans: dict[tuple[str, ...], Any] | None = None
    # Router replay's tap (rltrain/rollout/vllm_routing.py): a MoE on the CPU build, from the first join.
    rltrain_routing_tap: Any = None
    # Provided by vLLM's worker class this is mixed into.
    model_runner: Any
    device_config: Any
    device: Any

    def rltrain_join(self, spec_json: str) -> dict[str, Any]:
        """Join the trainer's pair group; answers this server's model fingerprint and version."""
        import torch.distributed as dist

        spec = json.loads(spec_json)
        if self.rltrain_group is not None:
            self.rltrain_group = None  # a trainer that rejoins (it restarted, or we were down)
        timeout_s = float(spec["timeout_s"])
        store = pair_store(spec["host"], int(spec["port"]), 1, timeout_s)
        self.rltrain_group = open_pair_group(store, 1, spec["backend"], timeout_s)
        # The first collective proves both ends are in.
        probe = torch.zeros(1, device=self._rltrain_device())
        self.rltrain_group.broadcast([probe], dist.BroadcastOptions()).wait()
        self._rltrain_tap_routing()
        return {"fingerprint": model_fingerprint(self.model_runner.model_config.model), "version": self.rltrain_version}

    def rltrain_receive(self, manifest_json: str) -> dict[str, Any]:
        """One version: every bucket of the manifest broadcast by the trainer, then loaded."""
        import torch.distributed as dist

        if self.rltrain_group is None:
            raise RuntimeError("rltrain_receive before rltrain_join: the trainer must join first")
        manifest = json.loads(manifest_json)
        device = self._rltrain_device()
        weights: list[tuple[str, torch.Tensor]] = []
        for bucket in manifest["buckets"]:
            bucket_u8 = torch.empty(int(bucket["nbytes"]), dtype=torch.uint8, device=device)
            self.rltrain_group.broadcast([bucket_u8], dist.BroadcastOptions()).wait()
            weights += unpack_bucket(bucket_u8, bucket["entries"])
        self._rltrain_load(weights)
        self._rltrain_tap_routing()  # a reload may rebuild a layer: its router is bound again
        self.rltrain_version = int(manifest["version"])
        return {"version": self.rltrain_version}

    def rltrain_take_routing(self, keys_json: str) -> str | None:
        """The records of the requests keyed `keys_json` (a JSON list, routing_wire.sample_key),
        forgotten here: a JSON object key -> [tokens, layers, k] as lists; None where this server
        records nothing (a dense model, a GPU: docs/moe.md)."""
        if self.rltrain_routing_tap is None or self.rltrain_routing_tap.layers == 0:
            return None
        taken = self.rltrain_routing_tap.take_keys(json.loads(keys_json))
        return json.dumps({key: record.tolist() for key, record in taken.items()})

    def _rltrain_tap_routing(self) -> None:
        """Tap a MoE's routers on the CPU build (once; bound again after each load), recording the
        requests rltrain's route marks (routing_wire.server_key)."""
        from rltrain.models.moe import is_moe
        from rltrain.rollout.server.routing_wire import server_key
        from rltrain.rollout.vllm_routing import RoutingTap

        if self.rltrain_routing_tap is None:
            if self.device_config.device_type != "cpu" or not is_moe(self.model_runner.model_config.hf_text_config):
                return
            self.rltrain_routing_tap = RoutingTap(self.model_runner, key_of=server_key)
            self.rltrain_routing_tap.armed = True  # always: only marked requests are kept, each taken by its route
        self.rltrain_routing_tap.bind(self.model_runner.get_model())

    def rltrain_server_id(self) -> str:
        """Who this server is (`SERVER_ID`): the fleet refuses two URLs that reach one server."""
        return SERVER_ID

    def rltrain_device(self) -> str:
        """"cpu" or "cuda": where this worker holds the model and receives the buckets, asked
        before the pair group opens (the trainer picks gloo or NCCL from it)."""
        return self._rltrain_device().type

    def _rltrain_device(self) -> torch.device:
        return torch.device("cpu") if self.device_config.device_type == "cpu" else torch.device(self.device)

    def _rltrain_load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """As the in-process engine (rltrain/rollout/vllm.py): the fast plan where it applies, else
        vLLM's own in-place reload (each MoE layer's CPU kernel set up again: `forget_moe_kernels`),
        and a tied output head repacked from the embedding."""
        from rltrain.rollout.vllm_reload import build_plan, forget_moe_kernels

        model = self.model_runner.model
        if self.device_config.device_type != "cpu":
            self.model_runner.reload_weights(weights_iterator=iter(weights))
            return
        names = tuple(name for name, _ in weights)
        if self.rltrain_plans is None:
            self.rltrain_plans = {}
        if names not in self.rltrain_plans:
            self.rltrain_plans[names] = build_plan(model, names)
        plan = self.rltrain_plans[names]
        if plan is None or not plan.load(model, weights):
            forget_moe_kernels(model)
            self.model_runner.reload_weights(weights_iterator=iter(weights))
            hf_config = self.model_runner.model_config.hf_config
            if getattr(hf_config, "tie_word_embeddings", False):
                # `lm_head`, or `language_model.lm_head` in a vision-language model.
                for name, head in model.named_modules():
                    if name.rpartition(".")[2] == "lm_head":
                        head.quant_method.process_weights_after_loading(head)
