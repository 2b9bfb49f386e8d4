"""`backend=megatron` layouts that cannot work are refused at config time, naming the key and fix.

The composed config goes through `rltrain.preflight.validate` exactly as `python -m rltrain` does, so these
run in milliseconds; one CLI run in tests/e2e/test_megatron_cli.py proves the message reaches the
user. What validation cannot read (an unsupported architecture) is refused by the engine with a
UserError instead of a megatron assertion.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import compose_config

from rltrain.preflight.validate import validate
from rltrain.preflight.world import data_parallel_size
from rltrain.runtime.errors import UserError


@pytest.fixture(autouse=True)
def _not_under_torchrun(monkeypatch) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _cfg(*overrides: str):
    return compose_config("backend=megatron", *overrides)


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["backend.tp=2", "trainer.nproc=3"], ["trainer.nproc=3", "backend.tp * backend.pp"]),
        (["backend.tp=2", "backend.pp=2", "trainer.nproc=2"], ["trainer.nproc=2", "multiple of 4"]),
        (["backend.pp=3", "trainer.nproc=3"], ["backend.pp=3", "model.num_layers=4"]),
        (["backend.tp=4", "trainer.nproc=4"], ["backend.tp=4", "model.num_kv_heads=2"]),
        (["backend.tp=2", "trainer.nproc=2", "model.num_heads=3", "model.hidden_size=96"], ["model.num_heads=3"]),
        (["backend.tp=2", "trainer.nproc=2", "model.intermediate_size=385"], ["model.intermediate_size=385"]),
        (["backend.tp=0"], ["backend.tp=0"]),
        (["model=tiny_moe", "backend.pp=2", "trainer.nproc=2", "model.moe.z_loss_coef=0.01"],
         ["model.moe.z_loss_coef", "backend.pp > 1", "Set backend.pp=1"]),
    ],
)
def test_impossible_layouts_name_the_key_and_the_fix(overrides: list[str], names: list[str]) -> None:
    with pytest.raises(UserError) as info:
        validate(_cfg(*overrides))
    for name in names:
        assert name in str(info.value)


def test_torchrun_world_size_decides_under_torchrun(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UserError, match="torchrun world size=3"):
        validate(_cfg("backend.tp=2"))


def test_valid_layouts_pass_and_batch_is_checked_per_replica() -> None:
    for overrides in (["backend.tp=2", "backend.pp=2", "trainer.nproc=4"], ["backend.pp=2", "trainer.nproc=2"]):
        validate(_cfg(*overrides))
    # tp=2 on 2 ranks is one data-parallel replica: a global batch of 1 feeds it.
    cfg = _cfg("backend.tp=2", "trainer.nproc=2", "trainer.global_batch_size=1", "trainer.micro_batch_size=1")
    assert data_parallel_size(cfg) == 1
    validate(cfg)


def test_model_path_config_is_checked_by_its_hugging_face_keys(tmp_path: Path) -> None:
    config = {"model_type": "qwen2", "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="num_hidden_layers in model.path's config.json=3"):
        validate(_cfg(f"model.path={tmp_path}", "backend.pp=2", "trainer.nproc=2"))


def test_engine_refuses_an_unsupported_architecture_as_a_user_error(tmp_path: Path) -> None:
    from transformers import GPT2Config

    from rltrain.backends.megatron.hf_source import checked_spec

    GPT2Config(n_layer=2, n_head=2, n_embd=32).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="backend=megatron cannot run the model.*qwen2, llama.*backend=fsdp"):
        checked_spec(tmp_path, tp=1, pp=1)


def _hf_config(path: Path, **extra) -> Path:
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
              "intermediate_size": 64} | extra
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "extra, overrides, names",
    [
        ({"num_experts": 8}, ["backend.ep=0"], ["backend.ep=0", "at least 1"]),
        ({"num_experts": 8}, ["backend.ep=2", "trainer.nproc=3"], ["backend.ep=2", "multiple of backend.ep * backend.pp = 2"]),
        ({"num_experts": 6}, ["backend.ep=4", "trainer.nproc=4"], ["backend.ep=4", "num_experts in model.path's config.json=6"]),
        ({"num_local_experts": 6}, ["backend.ep=4", "trainer.nproc=4"], ["num_local_experts in model.path's config.json=6"]),
        ({}, ["backend.ep=2", "trainer.nproc=2"], ["backend.ep=2 needs a Mixture-of-Experts model"]),
    ],
)
def test_expert_parallel_layouts_that_cannot_work_name_the_key(tmp_path: Path, extra, overrides, names) -> None:
    model = _hf_config(tmp_path, **extra)
    with pytest.raises(UserError) as info:
        validate(_cfg(f"model.path={model}", *overrides))
    for name in names:
        assert name in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["model=tiny_moe", "backend.ep=3", "trainer.nproc=3"], ["backend.ep=3 does not divide model.moe.num_experts=8"]),
        (["model=tiny", "backend.ep=2", "trainer.nproc=2"], ["backend.ep=2 needs a Mixture-of-Experts model", "model=tiny_moe"]),
    ],
)
def test_the_built_tiny_models_expert_count_is_checked_before_any_rank_starts(overrides, names) -> None:
    with pytest.raises(UserError) as info:
        validate(_cfg(*overrides))
    for name in names:
        assert name in str(info.value), str(info.value)


def test_expert_parallelism_over_data_parallel_ranks_passes(tmp_path: Path) -> None:
    from rltrain.preflight.world import validate_megatron_split

    cfg = _cfg(f"model.path={_hf_config(tmp_path, num_experts=8)}", "backend.ep=2", "trainer.nproc=2")
    assert data_parallel_size(cfg) == 2  # the experts' ranks are data-parallel replicas of the rest
    validate_megatron_split(cfg)  # (validate() would also want a tokenizer in model.path)
