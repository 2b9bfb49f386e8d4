"""The CPU sampler's rank count without vLLM's compiled kernel (rltrain/rollout/vllm_cpu_sampler.py)."""

from __future__ import annotations

import torch

from rltrain.rollout.vllm_cpu_sampler import count_at_least, use_eager_rank_count


def test_the_eager_count_equals_vllms_compiled_kernel_ties_included():
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    generator = torch.Generator().manual_seed(0)
    logprobs = torch.randn(7, 300, generator=generator).log_softmax(-1)
    logprobs[:, 150:160] = logprobs[:, 3:4]  # ties with the chosen token count as at least it
    chosen = logprobs.gather(-1, torch.tensor([[3], [0], [299], [150], [7], [42], [3]]))
    torch._dynamo.decorators.mark_unbacked(logprobs, 0)  # as vLLM's sampler calls it
    torch._dynamo.decorators.mark_unbacked(chosen, 0)
    assert torch.equal(count_at_least(logprobs, chosen), batched_count_greater_than(logprobs, chosen))
    assert count_at_least(logprobs, chosen)[0] >= 11  # the token and its 10 ties


def test_the_cpu_build_samples_with_the_eager_count():
    import vllm.v1.sample.sampler as sampler

    use_eager_rank_count()
    assert sampler.batched_count_greater_than is count_at_least
