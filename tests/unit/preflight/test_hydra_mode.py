"""rltrain/preflight/hydra_mode.py: Hydra's run mode without a second composition, and Hydra's own
lookup wherever a config could set the mode."""

from __future__ import annotations

import pytest

from rltrain.preflight.hydra_mode import mode_from_the_command_line, mode_may_be_configured


@pytest.mark.parametrize("overrides, argv, configured", [
    (["algo=grpo", "hydra.run.dir=/tmp/r", "hydra/launcher=submitit_local"], [], False),
    (["hydra.mode=MULTIRUN"], [], True),
    (["+hydra.searchpath=[file:///x]"], [], True),
    (["+experiment=grpo_gsm8k"], [], True),
    (["algo=sft"], ["--config-dir", "/mine"], True),
    (["algo=sft"], ["-cn=mine"], True),
])
def test_only_what_could_set_the_mode_is_composed_for_it(overrides, argv, configured):
    assert mode_may_be_configured(overrides, [*argv, *overrides]) is configured


def test_hydras_lookup_is_skipped_inside_and_back_after():
    from hydra._internal.hydra import Hydra

    calls = []
    original = Hydra.get_mode
    Hydra.get_mode = lambda self, name, overrides: calls.append(overrides) or "composed"  # type: ignore[method-assign]
    try:
        with mode_from_the_command_line(["algo=sft"]):
            assert Hydra.get_mode(None, "config", ["algo=sft"]) is None  # -m (or not) decides in Hydra's _run_app
            assert Hydra.get_mode(None, "config", ["hydra.mode=MULTIRUN"]) == "composed"
        assert Hydra.get_mode(None, "config", ["algo=sft"]) == "composed"
        assert calls == [["hydra.mode=MULTIRUN"], ["algo=sft"]]
    finally:
        Hydra.get_mode = original  # type: ignore[method-assign]
