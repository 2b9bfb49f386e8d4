"""Roles as Hydra groups: `reference`, `critic` and `reward_model` compose, swap on the command
line and are validated key by key; a role's model must share the policy's tokenizer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import compose_config

from rltrain.backends.roles import check_same_tokenizer, resolve_role_dirs
from rltrain.config.schema import ModelConfig
from rltrain.models.tiny import build_tiny_model_dir
from rltrain.models.tiny_reward import build_tiny_reward_model_dir
from rltrain.models.tokenizer import build_char_tokenizer
from rltrain.preflight.validate import validate
from rltrain.runtime.errors import UserError

SMALL = dict(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(autouse=True)
def _not_under_torchrun(monkeypatch) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Models of ours: a policy and another causal LM (other seed), a reward model, and a causal LM
    whose tokenizer has one extra token."""
    root = tmp_path_factory.mktemp("role_models")
    cfg = ModelConfig(cache_dir=str(root / "cache"), **SMALL)
    other_tokenizer = root / "other_tokenizer"
    build_tiny_model_dir(cfg, seed=3).rename(other_tokenizer)
    tokenizer = build_char_tokenizer()
    tokenizer.add_tokens(["<tool>"])
    tokenizer.save_pretrained(str(other_tokenizer))
    return {
        "policy": build_tiny_model_dir(cfg, seed=1),
        "other": build_tiny_model_dir(cfg, seed=2),
        "reward": build_tiny_reward_model_dir(root / "reward", seed=4, cfg=ModelConfig(**SMALL)),
        "other_tokenizer": other_tokenizer,
    }


def test_each_role_is_a_group_with_its_keys_in_the_composed_config():
    cfg = compose_config()
    assert cfg.reference.path is None
    assert cfg.critic.path is None and cfg.critic.lr == 1e-3  # its own, not optim.lr
    assert cfg.reward_model.name == "none" and cfg.reward_model.path is None
    assert set(cfg.reward_model) == {"name", "path", "revision", "weight", "batch_size", "max_length"}
    validate(cfg)
    swapped = compose_config("reward_model=hf", "reward_model.path=/some/dir", "reward_model.weight=0.5")
    assert swapped.reward_model.name == "hf" and swapped.reward_model.weight == 0.5


def test_a_misspelt_role_key_fails_at_composition():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose_config("reference.pth=/x")
    with pytest.raises(ConfigCompositionException):
        compose_config("reward_model=hf", "reward_model.batch=4")


def test_role_paths_that_are_models_of_ours_pass(models):
    validate(compose_config("algo=dpo", f"reference.path={models['other']}"))
    validate(compose_config("algo.beta=0.04", f"reference.path={models['other']}"))
    validate(compose_config("reward_model=hf", f"reward_model.path={models['reward']}"))


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["algo=dpo", "reference.path={tmp}/missing"], ["reference.path=", "no config.json", "policy's initial weights"]),
        (["algo=dpo", "reference.path={tmp}"], ["reference.path=", "no config.json"]),
        (["algo=sft", "reference.path={other}"], ["reference.path=", "algo=sft has no reference"]),
        (["reference.path={other}"], ["reference.path=", "algo.beta > 0", "algo.beta=0.04"]),
        (["critic.path={other}"], ["critic.path=", "algo=grpo has no critic"]),
        (["critic.lr=0"], ["critic.lr=0"]),
        (["reward_model=hf"], ["reward_model=hf needs reward_model.path"]),
        (["reward_model.path={reward}"], ["reward_model=none scores nothing", "Add reward_model=hf"]),
        (["reward_model=hf", "reward_model.path={other}"], ["is not a sequence classifier", "Qwen2ForCausalLM"]),
        (["reward_model=hf", "reward_model.path={tmp}/missing"], ["reward_model.path=", "no config.json"]),
        (["algo=dpo", "reward_model=hf", "reward_model.path={reward}"], ["algo=dpo uses no rewards"]),
        (["reward_model=hf", "reward_model.path={reward}", "reward_model.batch_size=0"], ["reward_model.batch_size=0"]),
        (["reward_model=hf", "reward_model.path={reward}", "reward_model.max_length=0"], ["reward_model.max_length=0"]),
        (["reward_model=hf", "reward_model.path={reward}", "reward_model.weight=nan"], ["reward_model.weight=nan"]),
    ],
)
def test_unusable_role_settings_name_the_key_and_the_fix(models, tmp_path, overrides, names):
    fill = {"tmp": tmp_path, "other": models["other"], "reward": models["reward"]}
    cfg = compose_config(*(o.format(**fill) for o in overrides))
    with pytest.raises(UserError) as info:
        validate(cfg)
    for name in names:
        assert name in str(info.value), str(info.value)


def test_a_reward_model_with_several_labels_is_refused(tmp_path, models):
    import json
    import shutil

    two = tmp_path / "two_labels"
    shutil.copytree(models["reward"], two)
    config = json.loads((two / "config.json").read_text())
    config["id2label"] = {"0": "bad", "1": "good"}
    (two / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="has 2 output labels"):
        validate(compose_config("reward_model=hf", f"reward_model.path={two}"))


def _policy_tokenizer(models):
    """The policy's tokenizer as the trainer loads it (from its directory)."""
    from rltrain.models.tokenizer import load_tokenizer

    return load_tokenizer(str(models["policy"]))


def test_role_dirs_name_the_roles_given_a_path_of_their_own(models):
    tokenizer = _policy_tokenizer(models)
    assert resolve_role_dirs(compose_config(), models["policy"], tokenizer, rank=0) == {}
    cfg = compose_config("algo=dpo", f"reference.path={models['other']}")
    assert resolve_role_dirs(cfg, models["policy"], tokenizer, rank=0) == {"reference": models["other"].resolve()}


def test_a_role_with_another_tokenizer_is_refused_naming_both_directories(models):
    cfg = compose_config("algo=dpo", f"reference.path={models['other_tokenizer']}")
    validate(cfg)  # a well-formed directory: only the tokenizer is wrong
    with pytest.raises(UserError) as info:
        resolve_role_dirs(cfg, models["policy"], _policy_tokenizer(models), rank=1)
    message = str(info.value)
    assert str(models["other_tokenizer"]) in message and str(models["policy"]) in message
    assert "the vocabularies have 100 and 101 tokens" in message
    assert "leave it null" in message


def test_special_tokens_and_token_splits_are_compared_too(models, tmp_path):
    swapped = build_char_tokenizer()
    swapped.eos_token = "<unk>"
    with pytest.raises(UserError, match=re.escape("eos_token: '<eos>' vs '<unk>'")):
        _check_against(swapped, models, tmp_path / "swapped")


def _check_against(tokenizer, models, directory: Path) -> None:
    import shutil

    shutil.copytree(models["policy"], directory)
    tokenizer.save_pretrained(str(directory))
    check_same_tokenizer("critic.path", directory, models["policy"], _policy_tokenizer(models))


def test_a_role_path_unreadable_on_this_rank_is_named(models, tmp_path):
    cfg = compose_config("algo=dpo", f"reference.path={tmp_path / 'gone'}")
    with pytest.raises(UserError, match=r"no config.json on rank 3: every rank reads the reference's model"):
        resolve_role_dirs(cfg, models["policy"], _policy_tokenizer(models), rank=3)


def test_one_vocabulary_split_differently_is_a_different_tokenizer():
    from tokenizers import pre_tokenizers

    from rltrain.backends.roles import tokenizer_difference

    words = build_char_tokenizer()
    words.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # drops spaces and newlines
    assert tokenizer_difference(build_char_tokenizer(), build_char_tokenizer()) == ""
    assert "the same text splits into different tokens" in tokenizer_difference(build_char_tokenizer(), words)
