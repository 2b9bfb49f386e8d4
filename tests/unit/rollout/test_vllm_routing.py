"""Router replay's record from vLLM's CPU engine (rltrain/rollout/vllm_routing.py, docs/moe.md
"Recording in vLLM"): which flattened row of a forward sampled which completion token, through a
chunked prefill, a cached prompt prefix, `n` samples and a recompute after preemption. The tap's
bookkeeping is driven here by a stand-in for vLLM's model runner (its batch's request order and
token counts, as `_prepare_inputs` sees them); the real engine's record against the trainer's
routing is checked in tests/unit/rollout/test_moe_rollout_parity.py and tests/e2e/test_cli_moe.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from rltrain.rollout.vllm_routing import RoutingTap, completion_routing

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
