"""`trainer.precision` resolves to one set of dtypes, and it is the only dtype setting of a run."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from hydra import compose, initialize_config_dir

from rltrain.runtime.precision import PRECISIONS, resolve_precision


@pytest.mark.parametrize(
    "name, device, resolved, param, compute",
    [
        ("auto", "cpu", "fp32", torch.float32, torch.float32),
        ("auto", "cuda", "bf16-mixed", torch.float32, torch.bfloat16),
        ("auto", torch.device("cuda", 1), "bf16-mixed", torch.float32, torch.bfloat16),
        ("fp32", "cuda", "fp32", torch.float32, torch.float32),
        ("bf16-mixed", "cpu", "bf16-mixed", torch.float32, torch.bfloat16),
        ("bf16", "cpu", "bf16", torch.bfloat16, torch.bfloat16),
    ],
)
def test_resolve_precision(name, device, resolved, param, compute):
    p = resolve_precision(name, device)
    assert (p.name, p.param_dtype, p.compute_dtype) == (resolved, param, compute)
    assert p.mixed == (resolved == "bf16-mixed")
    assert p.compute_dtype_name == {torch.float32: "float32", torch.bfloat16: "bfloat16"}[compute]
    assert getattr(torch, p.compute_dtype_name) is compute  # what transformers / vLLM are given


def test_unknown_precision_names_the_choices():
    with pytest.raises(ValueError, match="bf16-mixed"):
        resolve_precision("fp16", "cpu")


def test_autocast_only_for_mixed_precision():
    assert isinstance(resolve_precision("fp32", "cpu").autocast("cpu"), contextlib.nullcontext)
    assert isinstance(resolve_precision("bf16", "cpu").autocast("cpu"), contextlib.nullcontext)
    with resolve_precision("bf16-mixed", "cpu").autocast("cpu"):
        y = torch.nn.functional.linear(torch.ones(2, 4), torch.ones(3, 4))
    assert y.dtype == torch.bfloat16


def test_precision_is_the_only_dtype_key():
    from rltrain.__main__ import CONF_DIR
    from rltrain.config.schema import ModelConfig, TrainerConfig, register_configs
    from rltrain.preflight.validate import CHOICES, validate
    from rltrain.runtime.errors import UserError

    assert "dtype" not in {f.name for f in dataclasses.fields(ModelConfig)}
    assert TrainerConfig().precision == "auto"
    assert CHOICES["trainer.precision"] == PRECISIONS
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["trainer.precision=fp16"])
        with pytest.raises(UserError, match="trainer.precision"):
            validate(cfg)
        with pytest.raises(Exception, match="dtype"):
            compose("config", overrides=["model.dtype=bfloat16"])
