"""Hub ids for models (rltrain.config.hub): resolved offline from a cache laid out as huggingface_hub
writes it, a revision picked, a local directory preferred, and a missing id refused with both fixes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hub_cache import lay_model

from rltrain.config.hub import is_hub_id, local_model_dir, model_identity
from rltrain.preflight.sources import read_hf_config
from rltrain.runtime.errors import UserError


def model_files(tmp_path: Path, hidden: int) -> Path:
    """A model directory as far as resolution looks: config.json and a tokenizer file."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": hidden}))
    (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


def test_an_id_resolves_offline_from_the_cache_and_passes_validation(tmp_path):
    snapshot = lay_model("test-org/resolve-me", model_files(tmp_path / "m", 64))
    resolved = local_model_dir("model.path", "test-org/resolve-me", None)
    assert resolved == snapshot and json.loads((resolved / "config.json").read_text())["hidden_size"] == 64
    assert "/snapshots/" in str(resolved) and (resolved / "config.json").is_symlink()  # the real layout
    assert read_hf_config("model.path", "test-org/resolve-me", "leave it unset")["model_type"] == "qwen2"


def test_a_revision_picks_its_own_snapshot(tmp_path):
    lay_model("test-org/revisions", model_files(tmp_path / "main", 64))
    tagged = lay_model("test-org/revisions", model_files(tmp_path / "v1", 32), revision="v1")
    assert local_model_dir("model.path", "test-org/revisions", "v1") == tagged
    assert json.loads((local_model_dir("model.path", "test-org/revisions", None) / "config.json").read_text())["hidden_size"] == 64
    assert local_model_dir("model.path", "test-org/revisions", tagged.name) == tagged  # a commit hash
    assert model_identity("test-org/revisions", "v1") == "test-org/revisions@v1"


def test_a_missing_id_names_the_id_and_both_fixes():
    with pytest.raises(UserError) as info:
        local_model_dir("reference.path", "test-org/not-there", "v2")
    message = str(info.value)
    assert "reference.path='test-org/not-there'" in message and "'v2'" in message
    assert "HF_HUB_OFFLINE=1" in message and "not in the cache" in message
    assert "hf download test-org/not-there --revision v2" in message  # fix 1: fill the cache
    assert "local directory" in message and "save_pretrained" in message  # fix 2: a directory


def test_a_local_directory_wins_over_an_id_of_the_same_name(tmp_path, monkeypatch):
    lay_model("test-org/shadowed", model_files(tmp_path / "hub", 64))
    monkeypatch.chdir(tmp_path)
    model_files(tmp_path / "test-org" / "shadowed", 16)
    assert local_model_dir("model.path", "test-org/shadowed", None) == Path("test-org/shadowed")
    assert model_identity("test-org/shadowed", None) == str(tmp_path / "test-org" / "shadowed")


@pytest.mark.parametrize("value", ["/models/qwen", "./qwen", "~/qwen", "a/b/c", "runs/x/final/"])
def test_paths_are_not_ids(value):
    assert not is_hub_id(value)
    assert local_model_dir("model.path", value, None) == Path(value).expanduser()


def test_ids_are_ids():
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("gpt2")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.revision=v1"], "model.revision='v1' picks a version of a Hub id, but model.path=None"),
        (["algo=ppo", "critic.path=/nonexistent/critic", "critic.revision=v1"], "critic.revision='v1'"),
    ],
)
def test_a_revision_without_a_hub_id_is_refused(overrides, expected):
    from helpers import compose_config

    from rltrain.preflight.validate import validate

    with pytest.raises(UserError, match=re.escape(expected)):
        validate(compose_config(*overrides))


def test_every_role_takes_a_hub_id_through_validation(tmp_path):
    """reference.path, critic.path and reward_model.path resolve and validate like model.path."""
    from helpers import compose_config

    from rltrain.preflight.validate import validate

    lay_model("test-org/ref", model_files(tmp_path / "ref", 64), revision="v2")
    rm = model_files(tmp_path / "rm", 64)
    (rm / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"],
                                                "num_labels": 1}))
    lay_model("test-org/rm", rm)
    validate(compose_config("algo=ppo", "algo.beta=0.04", "reference.path=test-org/ref", "reference.revision=v2",
                            "critic.path=test-org/ref", "critic.revision=v2", "reward_model=hf", "reward_model.path=test-org/rm"))
    with pytest.raises(UserError, match=r"reward_model.path='test-org/rm' is not a local directory.*'v9'"):
        validate(compose_config("algo=grpo", "reward_model=hf", "reward_model.path=test-org/rm", "reward_model.revision=v9"))
