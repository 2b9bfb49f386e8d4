"""How the fleet splits a batch into requests (one contiguous run of prompts per server that is
up) and what the batch route keeps of vLLM's outputs, on hand-written cases."""

from __future__ import annotations

import math

from vllm.logprobs import FlatLogprobs, Logprob
from vllm.outputs import CompletionOutput, WeightVersionSpan

from rltrain.rollout.server.batch_requests import batch_chunks
from rltrain.rollout.server.batch_route import LOGPROB_FLOOR, compact_choice, sampled_logprobs


def test_a_batch_is_one_contiguous_run_per_server_up():
    assert batch_chunks(16, 1) == [range(0, 16)]
    assert batch_chunks(16, 3) == [range(0, 5), range(5, 10), range(10, 16)]
    assert batch_chunks(2, 4) == [range(0, 1), range(1, 2)]  # never an empty request
    assert batch_chunks(5, 0) == [range(0, 5)]  # none up: one request, which waits for a server
    assert batch_chunks(0, 2) == []



def flat(rows: list[dict[int, float]]) -> FlatLogprobs:
    out = FlatLogprobs()
    for row in rows:
        out.append({token: Logprob(logprob=value) for token, value in row.items()})
    return out


def test_the_batch_route_reads_each_sampled_tokens_logprob_from_either_container():
    token_ids = [5, 7, 9, 4]
    rows = [{5: -0.5}, {3: -0.1, 7: -1.25}, {9: -math.inf}, {4: math.nan}]
    expected = [-0.5, -1.25, LOGPROB_FLOOR, LOGPROB_FLOOR]  # vLLM's answer clamps -inf and NaN
    assert sampled_logprobs(token_ids, flat(rows)) == expected
    as_dicts = [{t: Logprob(logprob=v) for t, v in row.items()} for row in rows]
    assert sampled_logprobs(token_ids, as_dicts) == expected
    # No entry for the sampled token (vLLM's sentinel), in either container.
    assert sampled_logprobs([5, 6], flat([{5: -0.5}, {7: -2.0}])) == [-0.5, LOGPROB_FLOOR]
    assert sampled_logprobs([5, 6], [{5: Logprob(-0.5)}, None]) == [-0.5, LOGPROB_FLOOR]


def test_the_batch_route_keeps_tokens_float_logprobs_finish_and_versions():
    output = CompletionOutput(
        index=1, text="", token_ids=[5, 7], cumulative_logprob=None, logprobs=flat([{5: -0.5}, {7: -1.25}]),
        finish_reason="length", weight_versions=[WeightVersionSpan("3", 0, 1), WeightVersionSpan("4", 1, 2)],
    )
    assert compact_choice(output, with_logprobs=True) == {
        "index": 1, "token_ids": [5, 7], "finish_reason": "length", "logprobs": [-0.5, -1.25],
        "weight_versions": [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}],
    }
    # As vLLM's handler answers: no finish reason reads "stop"; no logprobs asked, none sent.
    output.finish_reason, output.weight_versions = None, None
    assert compact_choice(output, with_logprobs=False) == {
        "index": 1, "token_ids": [5, 7], "finish_reason": "stop", "logprobs": [], "weight_versions": None,
    }
