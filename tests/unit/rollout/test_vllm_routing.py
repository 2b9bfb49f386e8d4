"""Router replay's record from vLLM's CPU engine (rltrain/rollout/vllm_routing.py, docs/moe.md
"Recording in vLLM"): which flattened row of a forward sampled which completion token, through a
chunked prefill, a cached prompt prefix, `n` samples and a recompute after preemption. The tap's
bookkeeping is driven here by a stand-in for vLLM's model runner (its batch's request order and
token counts, as `_prepare_inputs` sees them); the real engine's record against the trainer's
routing is checked in tests/unit/rollout/test_moe_rollout_parity.py and tests/e2e/test_cli_moe.py.
In a server (rltrain/rollout/server/routing_wire.py) the record is kept by the batch route's key
and the seed, so two trainer ranks' requests with the same seeds keep theirs apart, and it
crosses HTTP as base64."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rltrain.algos.rl.inflight_rollouts import partial_rollouts
from rltrain.rollout.inflight_routing import StreamRecords
from rltrain.rollout.inflight_schedule import Group
from rltrain.rollout.server.batch_requests import answer_completions
from rltrain.rollout.server.routing_wire import (
    ROUTING_ARG,
    decode_routing,
    encode_routing,
    sample_key,
    server_key,
)
from rltrain.rollout.vllm_routing import RoutingTap, completion_routing
from rltrain.runtime.errors import UserError

LAYERS = 2


class Runner:
    """What the tap reads of vLLM's `GPUModelRunner`: the batch in row order and each request's seed."""

    def __init__(self, prompts: dict[str, int], seeds: dict[str, int]) -> None:
        self.prompts, self.computed = prompts, dict.fromkeys(prompts, 0)
        self.requests = {r: SimpleNamespace(sampling_params=SimpleNamespace(seed=s)) for r, s in seeds.items()}
        self.forwards = 0

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        self.forwards += 1

    def forward(self, tap: RoutingTap, scheduled: dict[str, int], computed: dict[str, int] | None = None) -> None:
        """One engine step: the batch's rows in `scheduled`'s order, each row's experts [row, row + 100]
        in layer 0 (+1000 in layer 1), so a record names the row it came from."""
        self.computed.update(computed or {})
        ids = list(scheduled)
        self.input_batch = SimpleNamespace(
            req_ids=ids,
            num_computed_tokens_cpu=np.array([self.computed[r] for r in ids]),
            num_prompt_tokens=np.array([self.prompts[r] for r in ids]),
        )
        counts = np.array([scheduled[r] for r in ids])
        self._prepare_inputs(None, counts)
        rows_N = torch.arange(int(counts.sum()))
        for layer in range(LAYERS):
            tap._capture(layer, torch.stack([rows_N, rows_N + 100], dim=1) + 1000 * layer)
        for r in ids:
            self.computed[r] += scheduled[r]


def test_the_row_that_sampled_each_token_is_kept_through_chunks_caches_samples_and_recompute():
    runner = Runner({"a": 5, "b0": 6, "b1": 6}, {"a": 10, "b0": 20, "b1": 21})  # b: n=2, seeds 20 and 21
    tap = RoutingTap(runner)
    tap.layers = LAYERS
    tap._capture(0, torch.zeros(3, 2, dtype=torch.long))  # a warm-up forward before any plan: ignored
    runner.forward(tap, {"a": 3})  # unarmed (the in-flight loop steps the engine): nothing kept
    assert tap.take() == {}
    runner.computed["a"] = 0

    tap.armed = True
    runner.forward(tap, {"a": 3, "b0": 6})  # a's first prefill chunk samples nothing; b0's last row (8) samples its token 0
    # a completes its prompt (row 1), b0 decodes (row 2), b1's prompt prefix is cached: only its last position (row 3)
    runner.forward(tap, {"a": 2, "b0": 1, "b1": 1}, {"b1": 5})
    runner.forward(tap, {"a": 1, "b1": 1})  # decode: a's token 1 at row 0, b1's token 1 at row 1
    runner.forward(tap, {"a": 7}, {"a": 0})  # a preempted and recomputed: prompt and its 2 tokens, row 6 samples token 2
    assert runner.forwards == 5  # vLLM's own `_prepare_inputs` still runs, every time

    records = tap.take()
    assert set(records) == {10, 20, 21} and not tap.armed and tap.records == {}

    def rows(seed: int) -> list[int]:
        record_TLK = records[seed]
        assert tuple(record_TLK.shape[1:]) == (LAYERS, 2)
        assert torch.equal(record_TLK[:, 1], record_TLK[:, 0] + 1000)  # every layer from the same row
        assert torch.equal(record_TLK[:, 0, 1], record_TLK[:, 0, 0] + 100)
        return record_TLK[:, 0, 0].tolist()

    assert rows(10) == [1, 0, 6]  # the recompute's earlier rows do not replace the tokens' own records
    assert rows(20) == [8, 2]
    assert rows(21) == [3, 1]


def test_a_completion_takes_its_own_tokens_and_reads_minus_one_past_the_record():
    record_TLK = torch.arange(3 * LAYERS * 2, dtype=torch.int16).reshape(3, LAYERS, 2)
    assert torch.equal(completion_routing({7: record_TLK}, 7, 2), record_TLK[:2])  # a forward past the stop
    longer = completion_routing({7: record_TLK}, 7, 4)
    assert longer is not None and torch.equal(longer[:3], record_TLK) and bool((longer[3] == -1).all())
    assert completion_routing({7: record_TLK}, 8, 2) is None


def test_a_servers_tap_keeps_two_ranks_requests_with_the_same_seeds_apart():
    """Two trainer ranks' requests at once on one server, seeded alike (each rank seeds its prompts
    by their index in its own batch): kept under the route's key and the seed, each taken by its
    own route while the other's stay; a request the route did not mark (another client's) is not kept."""
    runner = Runner({"r0": 4, "r1": 4, "x": 4}, {})
    marked = {"r0": "rank0", "r1": "rank1"}
    runner.requests = {
        r: SimpleNamespace(sampling_params=SimpleNamespace(seed=7, extra_args={ROUTING_ARG: marked[r]} if r in marked else None))
        for r in ("r0", "r1", "x")
    }
    tap = RoutingTap(runner, key_of=server_key)
    tap.layers, tap.armed = LAYERS, True
    runner.forward(tap, {"r0": 4, "r1": 4, "x": 4})  # last prompt rows 3, 7, 11 sample token 0
    runner.forward(tap, {"r1": 1, "r0": 1, "x": 1})  # decode: r1 at row 0, r0 at row 1
    taken = tap.take_keys([sample_key("rank0", 7)])
    assert list(taken) == ["rank0:7"] and taken["rank0:7"][:, 0, 0].tolist() == [3, 1]
    assert tap.armed and list(tap.records) == ["rank1:7"]  # the other rank's, still running, stays
    assert tap.take_keys([sample_key("rank1", 7), sample_key("rank1", 8)])["rank1:7"][:, 0, 0].tolist() == [7, 0]
    assert tap.records == {}


def test_a_record_crosses_http_as_base64_and_becomes_the_completions_routing():
    record_TLK = torch.tensor([[[0, 7], [3, -1]], [[5, 2], [1, 6]], [[-1, -1], [4, 0]]], dtype=torch.int16)
    wire = encode_routing(record_TLK)
    assert wire["shape"] == [3, 2, 2] and len(wire["b64"]) == 32  # 24 bytes of int16
    assert torch.equal(decode_routing(wire), record_TLK) and decode_routing(wire).dtype == torch.int16
    with pytest.raises(ValueError, match="does not fill the shape"):
        decode_routing({"shape": [4, 2, 2], "b64": wire["b64"]})
    choice = {"index": 0, "token_ids": [1, 2, 3], "logprobs": [-0.1, -0.2, -0.3], "finish_reason": "stop",
              "weight_versions": [{"version": "2", "start": 0, "end": 3}]}
    (with_record,) = answer_completions(5, {"choices": [{**choice, "routing": wire}]}, "http://s", 2, routing_required=True)
    assert with_record.routing is not None and torch.equal(with_record.routing, record_TLK)
    (without,) = answer_completions(5, {"choices": [{**choice, "routing": None}]}, "http://s", 2)
    assert without.routing is None
    with pytest.raises(UserError, match="returned no routing record") as info:  # replay on: a server that records none
        answer_completions(5, {"choices": [{**choice, "routing": None}]}, "http://s", 2, routing_required=True)
    assert "algo.router_replay=false" in str(info.value) and "python -m rltrain.serve" in str(info.value)


def test_the_in_flight_loop_files_each_finished_samples_record_into_its_group_and_batch():
    """In flight (rltrain/rollout/inflight_routing.py): seeds repeat across requests (here two
    groups seeded 7), so each request is kept under its own id and the sample's seed; a sample's
    record is taken when it finishes, cut to its tokens, and the others stay until theirs do. The
    batch's completions carry it per token, a token masked as too stale included."""
    prompts = {"0_g1": 3, "1_g1": 3, "0_g2": 3}  # vLLM's fan-out of g1's n=2 samples: seeds 7 and 8
    runner = Runner(prompts, {})
    parents = {"0_g1": ("g1", 7), "1_g1": ("g1", 8), "0_g2": ("g2", 7)}
    runner.requests = {
        r: SimpleNamespace(sampling_params=SimpleNamespace(seed=seed, extra_args=StreamRecords.extra_args(parent)))
        for r, (parent, seed) in parents.items()
    }
    tap = RoutingTap(runner, key_of=server_key)
    tap.layers, tap.armed = LAYERS, True
    records = StreamRecords(tap.take_keys)
    g1 = Group(1, 0, 1, 0, [1, 2, 3], seed=7, n=2)
    g2 = Group(2, 1, 1, 1, [1, 2, 3], seed=7, n=1)
    runner.forward(tap, {"0_g1": 3, "1_g1": 3, "0_g2": 3})  # prefill: rows 2, 5, 8 sample token 0
    runner.forward(tap, {"0_g1": 1, "1_g1": 1, "0_g2": 1})  # rows 0, 1, 2 sample token 1
    g1.token_ids[0], g1.versions[0] = [4, 5], [0, 1]
    records.sample_finished("g1", g1, 0)
    records.file()
    assert [t[0][0] for t in g1.routing[0]] == [2, 0] and g1.routing[1] is None
    assert set(tap.records) == {"g1:8", "g2:7"}  # still running: kept
    runner.forward(tap, {"0_g2": 1, "1_g1": 1})  # g2 at row 0, g1's second sample at row 1: token 2
    g1.token_ids[1], g1.versions[1] = [6, 7, 8], [1, 1, 1]
    g2.token_ids[0], g2.versions[0] = [9, 9], [1, 1]  # stopped at 2 tokens: the forward past it is cut
    records.sample_finished("g1", g1, 1)
    records.sample_finished("g2", g2, 0)
    records.file()
    assert tap.records == {} and records.finished == []
    rows = [{"index": g.index, "token_ids": g.token_ids, "logprobs": [[0.0] * len(t) for t in g.token_ids],
             "versions": g.versions, "finished": g.finished, "routing": g.routing} for g in (g1, g2)]
    completions, _, masked = partial_rollouts(json.loads(json.dumps(rows)), oldest_trained=1)
    assert masked == 1 and completions[0].sampled == [False, True]
    assert [c.routing[:, 0, 0].tolist() for c in completions] == [[2, 0], [5, 1, 1], [8, 2]]
    assert [c.routing[:, 1, 1].tolist() for c in completions] == [[1102, 1100], [1105, 1101, 1101], [1108, 1102]]
