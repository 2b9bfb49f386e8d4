"""vLLM on CUDA, checked without a GPU (docs/time-sharing-and-sync.md, "vLLM on CUDA"; CUDA vLLM cannot be installed here).

- `engine_kwargs` maps the rollout config to `vllm.LLM(...)` for the CPU build and for CUDA, and
  every key it produces is an engine argument of the installed vLLM (the same release as CUDA's).
- The methods the CUDA branch calls exist with the arguments it passes: `LLM.sleep(level)`,
  `LLM.wake_up(tags)`, the worker's `reload_weights(weights_iterator=...)`.
- The engine's CUDA branch, on a recording stand-in for `vllm.LLM` and a CUDA platform: the weight
  sync goes through `collective_rpc("reload_weights", ...)`, and sleep level 2 wakes the weights,
  loads them, then wakes the KV cache (vLLM's documented order).
- Bad values are refused at config time, naming the key.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from helpers import compose_config

from rltrain.config.group_options import VLLMRolloutConfig
from rltrain.preflight.validate import validate
from rltrain.rollout.base import SamplingSettings
from rltrain.rollout.vllm import VLLMRolloutEngine
from rltrain.rollout.vllm_args import GIB, engine_kwargs
from rltrain.runtime.errors import UserError

CUDA_CFG = VLLMRolloutConfig(
    max_model_len=2048, gpu_memory_utilization=0.6, tensor_parallel_size=2, enforce_eager=True, sleep_level=2
)


# --- the argument mapping ------------------------------------------------------------------------


def test_cpu_kwargs_have_no_gpu_settings_and_no_sleep_mode():
    kwargs = engine_kwargs(VLLMRolloutConfig(kv_cache_gib=2, max_model_len=128), "/m", "float32", "cpu", seed=3)
    assert kwargs == {
        "model": "/m",
        "dtype": "float32",
        "seed": 3,
        "max_model_len": 128,
        "max_num_seqs": 256,
        "logprobs_mode": "raw_logprobs",
        "enable_prefix_caching": True,
        "use_tqdm_on_load": False,
        "kv_cache_memory_bytes": 2 * GIB,
        "enforce_eager": True,  # the CPU build always runs eagerly, whatever rollout.enforce_eager says
    }


def test_cuda_kwargs_carry_every_gpu_setting():
    kwargs = engine_kwargs(CUDA_CFG, Path("/m"), "bfloat16", "cuda", seed=1)
    assert kwargs == {
        "model": "/m",
        "dtype": "bfloat16",
        "seed": 1,
        "max_model_len": 2048,
        "max_num_seqs": 256,
        "logprobs_mode": "raw_logprobs",
        "enable_prefix_caching": True,
        "use_tqdm_on_load": False,
        "gpu_memory_utilization": 0.6,
        "tensor_parallel_size": 2,
        "enforce_eager": True,
        "enable_sleep_mode": True,
    }
    defaults = engine_kwargs(VLLMRolloutConfig(), "/m", "float32", "cuda")
    assert defaults["max_model_len"] is None and defaults["gpu_memory_utilization"] == 0.5
    assert defaults["tensor_parallel_size"] == 1 and defaults["enforce_eager"] is False
    assert "kv_cache_memory_bytes" not in defaults  # gpu_memory_utilization sizes the KV cache on CUDA


def test_tensor_parallel_on_the_cpu_build_is_a_user_error():
    with pytest.raises(UserError, match="rollout.tensor_parallel_size=2"):
        engine_kwargs(VLLMRolloutConfig(tensor_parallel_size=2), "/m", "float32", "cpu")


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_every_kwarg_is_an_engine_argument_of_the_installed_vllm(device_type):
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    cfg = VLLMRolloutConfig() if device_type == "cpu" else CUDA_CFG
    assert set(engine_kwargs(cfg, "/m", "float32", device_type)) - {"model"} <= fields


def test_the_vllm_methods_the_cuda_branch_calls_exist():
    from vllm import LLM
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    assert "level" in inspect.signature(LLM.sleep).parameters
    assert "tags" in inspect.signature(LLM.wake_up).parameters
    assert "kwargs" in inspect.signature(LLM.collective_rpc).parameters
    assert hasattr(Worker, "reload_weights")  # collective_rpc("reload_weights") runs this on each worker
    assert "weights_iterator" in inspect.signature(GPUModelRunner.reload_weights).parameters


# --- the engine's CUDA branch on a stand-in -------------------------------------------------------


class FakeLLM:
    """Records the calls the engine makes to `vllm.LLM` (as a CUDA build would receive them)."""

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        self.loaded: list[dict[str, torch.Tensor]] = []

        class _Cfg:
            hf_config = type("HF", (), {"tie_word_embeddings": False})()

        calls = self.calls
        self.llm_engine = type(
            "E", (), {"model_config": _Cfg(), "reset_encoder_cache": lambda _self: calls.append(("reset_encoder_cache",))}
        )()

    def collective_rpc(self, method, kwargs=None, **_):
        kwargs = kwargs or {}
        weights = kwargs.get("weights_iterator")
        kind = None if weights is None else type(weights).__name__
        if weights is not None:
            self.loaded.append(dict(weights))
        self.calls.append(("collective_rpc", method, kind))
        return [None]

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, inputs, params, use_tqdm=False):
        self.calls.append(("generate",))
        return []

    def apply_model(self, fn):  # the CPU-only paths (SyncPlan, tied head) must not run on CUDA
        raise AssertionError("apply_model called on the CUDA branch")


@pytest.fixture
def cuda_engine(monkeypatch, tmp_path):
    """A `VLLMRolloutEngine` built by its own constructor on a CUDA platform and a fake `LLM`."""
    import vllm
    import vllm.platforms
    from safetensors.torch import save_file

    class CudaPlatform:
        device_type = "cuda"

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(vllm.platforms, "current_platform", CudaPlatform(), raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # restored after the test
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    save_file({"a.weight": torch.zeros(2), "b.weight": torch.ones(2)}, str(tmp_path / "model.safetensors"))

    def build(**overrides) -> VLLMRolloutEngine:
        return VLLMRolloutEngine(tmp_path, VLLMRolloutConfig(**overrides), seed=0, dtype="bfloat16")

    return build


WEIGHTS = [("a.weight", torch.full((2,), 3.0)), ("b.weight", torch.full((2,), 4.0))]


def test_cuda_engine_gets_cuda_kwargs_and_syncs_through_reload_weights(cuda_engine):
    engine = cuda_engine(gpu_memory_utilization=0.7)
    assert engine.llm.kwargs["enable_sleep_mode"] is True and engine.llm.kwargs["gpu_memory_utilization"] == 0.7
    engine.update_weights(iter(WEIGHTS))
    assert engine.llm.calls == [("collective_rpc", "reload_weights", "generator"), ("reset_prefix_cache",), ("reset_encoder_cache",)]
    assert torch.equal(engine.llm.loaded[0]["b.weight"], torch.full((2,), 4.0))
    with pytest.raises(ValueError, match="b.weight"):  # a partial update is still refused
        engine.update_weights(WEIGHTS[:1])


def test_tensor_parallel_workers_get_a_list(cuda_engine):
    engine = cuda_engine(tensor_parallel_size=2)
    engine.update_weights(iter(WEIGHTS))
    assert engine.llm.calls[0] == ("collective_rpc", "reload_weights", "list")  # crosses vLLM's RPC queue


def test_sleep_level_1_keeps_the_weights(cuda_engine):
    engine = cuda_engine(sleep_level=1)
    assert engine.weights_survive_sleep
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.update_weights(WEIGHTS)
    engine.wake()
    engine.generate([[1, 2]], SamplingSettings())
    assert engine.llm.calls == [("sleep", 1), ("wake_up", None), ("generate",)]


def test_sleep_level_2_wakes_weights_then_loads_then_wakes_the_kv_cache(cuda_engine):
    engine = cuda_engine(sleep_level=2)
    assert not engine.weights_survive_sleep
    # Before any update the checkpoint on disk is the engine's weights: a generate reloads it.
    engine.sleep()
    engine.wake()
    engine.generate([[1, 2]], SamplingSettings())
    assert engine.llm.calls == [
        ("sleep", 2),
        ("wake_up", ("weights",)),
        ("collective_rpc", "reload_weights", None),  # from disk
        ("wake_up", ("kv_cache",)),
        ("reset_prefix_cache",),
        ("reset_encoder_cache",),
        ("generate",),
    ]
    # The usual turn: wake the weights, load the trainer's, then the KV cache.
    engine.llm.calls.clear()
    engine.sleep()
    engine.wake()
    engine.update_weights(WEIGHTS)
    engine.generate([[1, 2]], SamplingSettings())
    assert engine.llm.calls == [
        ("sleep", 2),
        ("wake_up", ("weights",)),
        ("collective_rpc", "reload_weights", "generator"),
        ("wake_up", ("kv_cache",)),
        ("reset_prefix_cache",),
        ("reset_encoder_cache",),
        ("generate",),
    ]
    # After an update, a wake without one would generate from discarded memory: refused.
    engine.sleep()
    engine.wake()
    with pytest.raises(RuntimeError, match="level=2"):
        engine.generate([[1, 2]], SamplingSettings())


# --- validation -------------------------------------------------------------------------------------


def _cfg(*overrides: str):
    return compose_config("rollout=vllm", *overrides)


@pytest.mark.parametrize(
    "override",
    [
        "rollout.gpu_memory_utilization=0",
        "rollout.gpu_memory_utilization=1.5",
        "rollout.sleep_level=3",
        "rollout.tensor_parallel_size=0",
        "rollout.max_model_len=0",
    ],
)
def test_bad_values_are_refused_naming_the_key(override, monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UserError, match=override.split("=")[0].replace(".", r"\.")):
        validate(_cfg(override))


def test_good_values_pass(monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    validate(_cfg("rollout.gpu_memory_utilization=1", "rollout.sleep_level=2", "rollout.max_model_len=4096",
                  "rollout.tensor_parallel_size=2", "rollout.enforce_eager=true"))


def test_fp8_rollouts_are_refused_on_the_cpu_build_naming_what_is_missing():
    with pytest.raises(UserError, match=r"static_scaled_fp8_quant\(\) -> \(\)"):
        engine_kwargs(VLLMRolloutConfig(quantization="fp8"), "/m", "bfloat16", "cpu")


def test_fp8_rollouts_on_cuda_quantize_a_16_bit_engine():
    assert engine_kwargs(VLLMRolloutConfig(quantization="fp8"), "/m", "bfloat16", "cuda")["quantization"] == "fp8"
    assert "quantization" not in engine_kwargs(VLLMRolloutConfig(), "/m", "bfloat16", "cuda")
    with pytest.raises(UserError, match="trainer.precision=bf16-mixed"):
        engine_kwargs(VLLMRolloutConfig(quantization="fp8"), "/m", "float32", "cuda")
