"""Hydra's composition errors become one `rltrain: error:` paragraph with the fix
(rltrain/preflight/compose_errors.py): the real exceptions Hydra raises for each kind of bad override."""

from __future__ import annotations

import os

import pytest
from helpers import compose_config

from rltrain.config.algorithms import ALGORITHMS
from rltrain.preflight.compose_errors import composition_done, describe, reporting_composition_errors


def _error_of(*overrides: str) -> BaseException:
    with pytest.raises(Exception) as info:
        compose_config(*overrides)
    return info.value


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["trainer.max_stepz=5"], "unknown config key 'trainer.max_stepz': there is no 'max_stepz' in 'trainer'. Did you mean trainer.max_steps?"),
        (["trainr.max_steps=5"], "there is no 'trainr' at the top level. Did you mean trainer?"),
        (["algo=sft", "algo.beta=0.1"], "there is no 'beta' in 'algo'. Its keys: name."),
        (["trainer.max_steps=abc"], "bad value for 'trainer.max_steps': Value 'abc' of type 'str' could not be converted to Integer."),
        (["algo=gpro"], f"algo=gpro: there is no such option in the 'algo' group. Did you mean grpo? Choose from: {', '.join(sorted(ALGORITHMS))}."),
        (["env=verifiers"], "env=verifiers: there is no such option in the 'env' group. verifiers environments are not supported yet"),
        (["model=huge"], "Choose from: tiny, tiny_moe, tiny_moe_sft, tiny_sft, tiny_vl, tiny_vl_sft."),
        (["trainer.max_steps=[1"], "cannot parse the override 'trainer.max_steps=[1'"),
        (["backend.ep=2"], "backend.ep is a key of backend=megatron, not of backend=fsdp. backend=fsdp has no expert "
         "parallelism"),
        (["backend=megatron", "backend.padding_free=true"], "backend.padding_free is a key of backend=fsdp, not of "
         "backend=megatron. Use backend=fsdp to set it."),
    ],
)
def test_each_kind_of_bad_override_is_named_with_its_fix(overrides, expected):
    message = describe(_error_of(*overrides))
    assert message is not None and expected in message, message
    assert "\n" not in message


def test_other_exceptions_keep_their_own_report():
    assert describe(ValueError("a bug")) is None


def test_the_run_does_not_inherit_the_composition_setting(monkeypatch, capsys):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with reporting_composition_errors():
        assert os.environ["HYDRA_FULL_ERROR"] == "1"  # composing: errors reach us
        composition_done()  # the job's first call
        assert "HYDRA_FULL_ERROR" not in os.environ  # the job and its ranks: Hydra's own reports
    with pytest.raises(SystemExit) as info, reporting_composition_errors():
        raise _error_of("algo=gpro")
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("rltrain: error: algo=gpro: ")
    assert "HYDRA_FULL_ERROR" not in os.environ


def test_a_user_who_asked_for_full_errors_gets_hydras(monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    error = _error_of("algo=gpro")
    with pytest.raises(type(error)), reporting_composition_errors():
        raise error
    assert os.environ["HYDRA_FULL_ERROR"] == "1"


def test_a_key_added_with_plus_where_the_schema_has_none_is_refused():
    from rltrain.preflight.compose_errors import added_keys

    assert added_keys(compose_config("algo=grpo")) == []
    assert added_keys(compose_config("algo=ppo", "reward_model=hf")) == []
    assert added_keys(compose_config("algo=sft", "+trainer.max_stepz=5", "+newsec.x=1")) == ["trainer.max_stepz", "newsec"]
