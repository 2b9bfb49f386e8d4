"""The transformers rollout engine honours the same contract as the vLLM one."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rltrain.config.group_options import HFRolloutConfig
from rltrain.config.schema import ModelConfig
from rltrain.models.tiny import build_tiny_model_dir
from rltrain.rollout.base import Completion, SamplingSettings
from rltrain.rollout.hf import HFRolloutEngine

TINY = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
PROMPTS = [[1, 20, 21, 22], [1, 40, 41], [1, 60, 61, 62, 63, 64]]
EOS = 2  # the char tokenizer's <eos>


def max_logprob_diff(
    model: torch.nn.Module, prompts: list[list[int]], completions: list[Completion]
) -> float:
    worst = 0.0
    with torch.no_grad():
        for c in completions:
            prompt = prompts[c.prompt_index]
            ids_T = torch.tensor(prompt + c.token_ids)
            logps_TV = torch.log_softmax(model(ids_T[None]).logits[0].float(), dim=-1)
            ref_N = logps_TV[len(prompt) - 1 : -1].gather(-1, ids_T[len(prompt) :, None])[:, 0]
            worst = max(worst, float((ref_N - torch.tensor(c.logprobs)).abs().max()))
    return worst


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def setup(request, tiny_cache):
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(**TINY, tie_word_embeddings=request.param, cache_dir=str(tiny_cache / "models"))
    model_dir = build_tiny_model_dir(cfg, seed=0)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return trainer, HFRolloutEngine(model_dir, HFRolloutConfig(), seed=0)


def test_parity_after_update(setup):
    trainer, engine = setup
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    stale = max_logprob_diff(trainer, PROMPTS, engine.generate(PROMPTS, SamplingSettings(n=2, seed=1)))
    engine.update_weights((n, p.detach().clone()) for n, p in trainer.named_parameters())
    completions = engine.generate(PROMPTS, SamplingSettings(n=4, temperature=0.7, top_p=0.9, seed=2))
    assert stale > 0.1  # the perturbation matters
    assert max_logprob_diff(trainer, PROMPTS, completions) < 1e-4


def test_update_weights_rejects_unknown_names_and_shapes(setup):
    _, engine = setup
    with pytest.raises(KeyError, match="no_such"):
        engine.update_weights([("no_such.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])


def test_generate_contract(setup):
    """n per prompt in prompt-major order; a stop token ends (and is kept in) a completion; seeded."""
    _, engine = setup
    state = torch.random.get_rng_state()
    free = engine.generate(PROMPTS, SamplingSettings(n=3, max_new_tokens=10, seed=7))
    assert torch.equal(torch.random.get_rng_state(), state), "generate must not move the global RNG"
    check_stop_contract(engine, free)


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


def test_samples_the_whole_distribution(setup):
    """No hidden top-k (transformers' default is 50): at a high temperature the tiny model reaches most of
    its 128 tokens in 400 one-token samples."""
    _, engine = setup
    completions = engine.generate(
        [PROMPTS[0]], SamplingSettings(n=400, max_new_tokens=1, temperature=10.0, seed=11)
    )
    assert len({c.token_ids[0] for c in completions}) > 80


def test_sleep_wake_ping(setup):
    _, engine = setup
    assert engine.ping()
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, SamplingSettings())
    engine.wake()
    assert len(engine.generate(PROMPTS, SamplingSettings(max_new_tokens=3))) == len(PROMPTS)


def test_import_does_not_import_vllm():
    code = "import sys, rltrain.rollout.hf, rltrain.rollout.vllm; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_ping_runs_the_model_and_never_waits_for_the_training_loop(setup):
    """A real ping: a one-token forward whose logits must be finite; while the training loop is
    inside the engine (its gate held), True at once without entering."""
    import threading
    from types import SimpleNamespace

    _, engine = setup
    calls: list[int] = []
    real = engine.model.forward
    try:
        engine.model.forward = lambda *a, **k: calls.append(1) or real(*a, **k)
        assert engine.ping() is True and calls == [1]

        entered, release = threading.Event(), threading.Event()

        def busy():
            with engine._gate:
                entered.set()
                release.wait(10)

        thread = threading.Thread(target=busy)
        thread.start()
        entered.wait(10)
        assert engine.ping() is True and calls == [1]  # not entered while busy
        release.set()
        thread.join(10)

        engine.model.forward = lambda *a, **k: SimpleNamespace(logits=torch.full((1, 1, 4), float("nan")))
        with pytest.raises(RuntimeError, match="non-finite"):
            engine.ping()
    finally:
        del engine.model.forward
    assert engine.ping() is True
