"""Rollout weights equal trainer weights (DESIGN.md invariant 3), on vLLM's CPU build.

For each tiny architecture we build one vLLM engine, perturb every tensor of a Hugging Face copy
of the model, push the perturbed tensors with `update_weights`, sample, and require the engine's
sampling log-probabilities to equal the Hugging Face model's temperature-1 log-softmax of the same
tokens. The tied-embedding cases also show that vLLM's in-place reload alone leaves the output
head stale (the trap `VLLMRolloutEngine._refresh_tied_head` exists for).
"""

from __future__ import annotations

import time

import pytest
import torch

from rltrain.config.group_options import VLLMRolloutConfig
from rltrain.config.schema import ModelConfig
from rltrain.models.tiny import build_tiny_model_dir
from rltrain.rollout.base import Completion, SamplingSettings

# One worker runs the module, in pytest's order: each architecture's engine is built once (the
# module-scoped `case`), not once per worker that draws one of its tests.
pytestmark = pytest.mark.xdist_group("test_rollout_parity")

TINY = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
CASES = {
    "qwen2-tied": dict(arch="qwen2", tie_word_embeddings=True, attention_bias=True),
    "qwen2-untied": dict(arch="qwen2", tie_word_embeddings=False, attention_bias=True),
    "llama-nobias": dict(arch="llama", tie_word_embeddings=False, attention_bias=False),
    "llama-bias-tied": dict(arch="llama", tie_word_embeddings=True, attention_bias=True),
}
PROMPTS = [[1, 20, 21, 22], [1, 40, 41], [1, 60, 61, 62, 63, 64]]
EOS = 2  # the char tokenizer's <eos>
TOL = 1e-3


def perturbed_state(model: torch.nn.Module, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Every named parameter plus Gaussian noise (a stand-in for an optimizer step)."""
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def max_logprob_diff(
    hf_model: torch.nn.Module, prompts: list[list[int]], completions: list[Completion]
) -> float:
    """Largest |engine logprob - HF temperature-1 log-softmax| over every sampled token."""
    worst = 0.0
    with torch.no_grad():
        for c in completions:
            if not c.token_ids:
                continue
            prompt = prompts[c.prompt_index]
            ids_T = torch.tensor(prompt + c.token_ids)
            logps_TV = torch.log_softmax(hf_model(ids_T[None]).logits[0].float(), dim=-1)
            ref_N = logps_TV[len(prompt) - 1 : -1].gather(-1, ids_T[len(prompt) :, None])[:, 0]
            worst = max(worst, float((ref_N - torch.tensor(c.logprobs)).abs().max()))
    return worst


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_cache):
    """(name, model_dir, HF model, engine, construction seconds): one engine per architecture."""
    from transformers import AutoModelForCausalLM

    from rltrain.rollout.vllm import VLLMRolloutEngine

    cfg = ModelConfig(**TINY, **CASES[request.param], cache_dir=str(tiny_cache / "models"))
    model_dir = build_tiny_model_dir(cfg, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    engine = VLLMRolloutEngine(
        model_dir, VLLMRolloutConfig(kv_cache_gib=1, max_num_seqs=16, max_model_len=128), seed=0
    )
    built_s = time.perf_counter() - t0
    yield request.param, model_dir, hf, engine, built_s
    engine.close()


def test_parity_after_update(case):
    name, _, hf, engine, built_s = case
    sampling = SamplingSettings(n=4, max_new_tokens=16, seed=1)
    before = engine.generate(PROMPTS, sampling)
    assert max_logprob_diff(hf, PROMPTS, before) < TOL, "parity before any update"

    state = perturbed_state(hf, seed=1)
    hf.load_state_dict(state, strict=False)
    engine.update_weights(state.items())
    t0 = time.perf_counter()
    after = engine.generate(PROMPTS, sampling)
    gen_s = time.perf_counter() - t0
    diff = max_logprob_diff(hf, PROMPTS, after)
    tokens = sum(len(c.token_ids) for c in after)
    print(f"\n[{name}] engine built in {built_s:.1f}s; {tokens} tokens in {gen_s:.2f}s; max diff {diff:.2e}")
    assert diff < TOL


def test_the_cpu_builds_kernel_overrides_are_registered_once_per_process(case, monkeypatch):
    """vLLM registers them at every engine's start, scanning every module; the process's first
    engine did (this module's), so a later one, or a second call, scans nothing."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    from rltrain.rollout.vllm_process_state import register_kernel_overrides_once

    assert dispatcher._registry, "the engine registered no override"
    scans: list[object] = []
    monkeypatch.setattr(dispatcher, "_rebind_kernels", scans.append)
    register_kernel_overrides_once()
    current_platform.register_triton_kernel_overrides()
    assert scans == []


def test_the_kv_cache_is_what_its_sequences_can_fill(case):
    """Of the 1 GiB budget the engine takes what 16 sequences of 128 tokens fill, plus one
    sequence's headroom (rltrain/rollout/kv_budget.py), and vLLM finds every sequence room."""
    engine = case[3]
    cache = engine.llm.llm_engine.vllm_config.cache_config
    tokens = cache.num_gpu_blocks * cache.block_size
    assert 16 * 128 <= tokens <= 17 * 128 + cache.block_size, (cache.num_gpu_blocks, cache.block_size)


def test_parity_ignores_sampling_settings(case):
    """Log-probabilities are of the raw distribution, whatever temperature and top-p sample."""
    _, _, hf, engine, _ = case
    completions = engine.generate(PROMPTS, SamplingSettings(n=2, temperature=0.7, top_p=0.9, seed=3))
    assert max_logprob_diff(hf, PROMPTS, completions) < TOL


@pytest.mark.parametrize(
    "case", [name for name, c in CASES.items() if c["tie_word_embeddings"]], indirect=True
)
def test_tied_head_is_stale_without_the_fix(case):
    """vLLM's reload alone keeps the old packed output head of a tied model; update_weights fixes it."""
    name, _, hf, engine, _ = case
    state = perturbed_state(hf, seed=2, scale=0.2)
    hf.load_state_dict(state, strict=False)
    sampling = SamplingSettings(n=2, max_new_tokens=12, seed=5)

    engine._reload_in_place(state.items())  # what vLLM does on its own
    engine.llm.reset_prefix_cache()
    stale = max_logprob_diff(hf, PROMPTS, engine.generate(PROMPTS, sampling))
    engine.update_weights(state.items())
    fixed = max_logprob_diff(hf, PROMPTS, engine.generate(PROMPTS, sampling))
    print(f"\n[{name}] tied head: diff {stale:.3f} with vLLM's reload alone, {fixed:.2e} with update_weights")
    assert stale > 0.1
    assert fixed < TOL


@pytest.mark.parametrize("case", ["qwen2-tied"], indirect=True)
def test_partial_update_raises_and_full_update_repairs(case):
    _, _, hf, engine, _ = case
    state = perturbed_state(hf, seed=4)
    hf.load_state_dict(state, strict=False)
    partial = [(n, t) for n, t in state.items() if "k_proj" not in n]
    with pytest.raises(ValueError, match="k_proj"):
        engine.update_weights(partial)
    engine.update_weights(state.items())
    completions = engine.generate(PROMPTS, SamplingSettings(n=2, seed=6))
    assert max_logprob_diff(hf, PROMPTS, completions) < TOL


@pytest.mark.parametrize("case", ["llama-nobias"], indirect=True)
def test_generate_contract(case):
    """n per prompt in prompt-major order; a stop token ends (and is kept in) a completion; seeded."""
    _, _, _, engine, _ = case
    state = torch.random.get_rng_state()
    free = engine.generate(PROMPTS, SamplingSettings(n=3, max_new_tokens=10, seed=7))
    assert torch.equal(torch.random.get_rng_state(), state), "generate must not move the global RNG"
    check_stop_contract(engine, free)
    # the n samples of one prompt differ, and identical prompts in one call differ too
    twins = engine.generate([PROMPTS[0], PROMPTS[0]], SamplingSettings(n=2, max_new_tokens=10, seed=9))
    assert len({tuple(c.token_ids) for c in twins}) == 4


def check_stop_contract(engine, free: list[Completion]) -> None:
    """`free` was sampled without stop tokens; with the same seed, stop tokens must cut it at the first one."""
    assert [c.prompt_index for c in free] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(len(c.logprobs) == len(c.token_ids) for c in free)
    assert all(len(c.token_ids) == 10 or (c.finished and c.token_ids[-1] == EOS) for c in free)
    stops = {c.token_ids[3] for c in free if len(c.token_ids) > 3} - {
        t for c in free for t in c.token_ids[:3]
    }
    assert stops
    cut = engine.generate(
        PROMPTS, SamplingSettings(n=3, max_new_tokens=10, seed=7, stop_token_ids=sorted(stops))
    )
    for a, b in zip(free, cut, strict=True):
        hits = [k for k, t in enumerate(a.token_ids) if t in stops]
        if hits:  # the same seed samples the same tokens up to (and including) the first stop
            assert b.finished and b.token_ids == a.token_ids[: hits[0] + 1]
            assert b.logprobs == pytest.approx(a.logprobs[: hits[0] + 1], abs=1e-5)
        else:
            assert b.token_ids == a.token_ids and b.finished == a.finished
    again = engine.generate(PROMPTS, SamplingSettings(n=3, max_new_tokens=10, seed=7))
    assert [c.token_ids for c in again] == [c.token_ids for c in free]
    other = engine.generate(PROMPTS, SamplingSettings(n=3, max_new_tokens=10, seed=8))
    assert [c.token_ids for c in other] != [c.token_ids for c in free]


@pytest.mark.parametrize("case", ["qwen2-untied"], indirect=True)
def test_samples_the_whole_distribution(case):
    """No hidden top-k: at a high temperature the tiny model reaches most of its 128 tokens."""
    _, _, _, engine, _ = case
    completions = engine.generate(
        [PROMPTS[0]], SamplingSettings(n=400, max_new_tokens=1, temperature=2.0, seed=11)
    )
    assert len({c.token_ids[0] for c in completions}) > 80


@pytest.mark.parametrize("case", ["qwen2-untied"], indirect=True)
def test_sleep_wake_ping(case):
    _, _, _, engine, _ = case
    assert engine.ping()
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, SamplingSettings())
    engine.wake()
    assert engine.ping()
    assert len(engine.generate(PROMPTS, SamplingSettings(n=1, max_new_tokens=4))) == len(PROMPTS)


def _process_state_check(_rank: int, _world: int, model_dir: str) -> bool:
    """On one gloo rank (the trainer's process group, which vLLM adopts as its world)."""
    import gc
    import random
    import weakref

    import torch.distributed as dist

    from rltrain.rollout.vllm import VLLMRolloutEngine
    from rltrain.runtime.process_state import settle_owed_collection

    torch.set_num_threads(3)  # neither 1 (what vLLM's CPU worker may set) nor this machine's default
    torch.manual_seed(123)
    random.seed(123)
    expected_torch, expected_py = torch.rand(3), random.random()
    torch.manual_seed(123)
    random.seed(123)
    engine = VLLMRolloutEngine(model_dir, VLLMRolloutConfig(kv_cache_gib=1, max_num_seqs=4, max_model_len=64), seed=99)
    engine.generate([[1, 2, 3]], SamplingSettings(n=2, max_new_tokens=4))
    full_collections: list[int] = []
    gc.callbacks.append(lambda phase, info: full_collections.append(1) if (phase, info["generation"]) == ("start", 2) else None)
    llm = weakref.ref(engine.llm)
    engine.close()
    assert full_collections == [], "close collected the heap: on the CPU the collection is owed"
    assert gc.collect.__name__ == "collect", "gc.collect is still the deferred no-op"
    settle_owed_collection()  # what the process's next run or engine does first
    settle_owed_collection()  # settled once
    gc.callbacks.pop()
    assert llm() is None, "the closed engine is still alive after the owed collection"
    assert len(full_collections) == 1, f"the owed collection ran {len(full_collections)} times, not once"
    assert torch.equal(torch.rand(3), expected_torch), "torch RNG moved"
    assert random.random() == expected_py, "Python RNG moved"
    assert torch.get_num_threads() == 3, "torch threads changed"
    assert "skip" not in torch.set_num_threads.__name__, "torch.set_num_threads is still vLLM's no-op"
    assert dist.is_initialized(), "the trainer's process group was destroyed"
    ones = torch.ones(2)
    dist.all_reduce(ones)
    return True


def test_construction_keeps_process_state(tiny_cache):
    """Building and closing an in-process engine must not reseed the trainer's RNG, pin torch to
    one thread, or destroy the trainer's process group (which vLLM adopts as its world); closing
    leaves one collection of the heap owed (not vLLM's three), which frees the engine. In a
    fresh process (forked from the ranks' server, which never imports vLLM): its own process group
    must not meet the engines of the other tests."""
    from helpers import run_ranks

    cfg = ModelConfig(**TINY, **CASES["qwen2-untied"], cache_dir=str(tiny_cache / "models"))
    model_dir = build_tiny_model_dir(cfg, seed=0)
    assert run_ranks(_process_state_check, str(model_dir), nproc=1, timeout_s=300) == [True]
