"""How the fleet splits a batch into requests (one contiguous run of prompts per server that is
up) and what the batch route keeps of vLLM's answer, on hand-written cases."""

from __future__ import annotations

from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    GenerateLogProbs,
    GenerateLogProbsContent,
    GenerateTokensChoice,
    GenerateTokensResponse,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo

from rltrain.rollout.server.batch_requests import batch_chunks
from rltrain.rollout.server.batch_route import compact


def test_a_batch_is_one_contiguous_run_per_server_up():
    assert batch_chunks(16, 1) == [range(0, 16)]
    assert batch_chunks(16, 3) == [range(0, 5), range(5, 10), range(10, 16)]
    assert batch_chunks(2, 4) == [range(0, 1), range(1, 2)]  # never an empty request
    assert batch_chunks(5, 0) == [range(0, 5)]  # none up: one request, which waits for a server
    assert batch_chunks(0, 2) == []


def test_the_batch_route_keeps_tokens_float_logprobs_finish_and_versions():
    choice = GenerateTokensChoice(
        index=1, finish_reason="length", token_ids=[5, 7],
        logprobs=GenerateLogProbs(content=[GenerateLogProbsContent(token_id=5, logprob=-0.5),
                                           GenerateLogProbsContent(token_id=7, logprob=-1.25)]),
    )
    answer = GenerateTokensResponse(request_id="r", model="m", choices=[choice], usage=UsageInfo(prompt_tokens=1))
    assert compact(answer) == {
        "choices": [{"index": 1, "token_ids": [5, 7], "finish_reason": "length", "logprobs": [-0.5, -1.25],
                     "weight_versions": None}],
        "prompt_token_ids": None,
    }
