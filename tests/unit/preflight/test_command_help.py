"""`python -m rltrain --help` is rltrain's one screen (rltrain/preflight/command_help.py): every group of
conf/ with its real options (no `*_schema` entry of the ConfigStore), the chosen one marked, keys that
exist, and short enough to read without scrolling."""

from __future__ import annotations

import pytest

from rltrain.config.schema import CONF_DIR, register_configs
from rltrain.preflight.command_help import COMMON_KEYS, command_help, group_options

MAX_LINES = 47  # under a 50-line screen, with the recipes list wrapped to three lines
MAX_WIDTH = 100


def _composed_with_choices(*overrides: str):
    """The composed config with its `hydra` node (`hydra.runtime.choices`), as Hydra gives it to `--help`."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize("algo", ["sft", "grpo"])
def test_the_page_lists_each_groups_options_and_marks_the_chosen_one(algo):
    page = command_help(_composed_with_choices(f"algo={algo}", "backend=megatron"))
    assert "_schema" not in page and "Hydra" in page  # only as the pointer to --hydra-help
    for group, options in group_options().items():
        assert options and all(option in page for option in options), (group, options)
    assert f"[{algo}]" in page and "[megatron]" in page and "[fsdp]" not in page


def test_the_options_are_read_from_conf(tmp_path, monkeypatch):
    import rltrain.preflight.command_help as command_help_module

    for name in ("algo/sft.yaml", "algo/newalgo.yaml", "hydra/launcher/slurm.yaml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    monkeypatch.setattr(command_help_module, "CONF_DIR", str(tmp_path))
    assert group_options() == {"algo": ["newalgo", "sft"]}


def test_every_key_shown_exists_and_the_page_fits_one_screen():
    composed = [_composed_with_choices(f"algo={algo}") for algo in ("sft", "grpo")]
    from omegaconf import OmegaConf

    missing = [key for key, _ in COMMON_KEYS if all(OmegaConf.select(c, key, default="<absent>") == "<absent>" for c in composed)]
    assert not missing, f"--help names keys the schema lacks: {missing}"
    page = command_help(composed[1])
    lines = page.splitlines()
    assert len(lines) <= MAX_LINES, len(lines)
    assert max(len(line) for line in lines) <= MAX_WIDTH, max(lines, key=len)
    assert "trainer.nproc=1 " in page  # the current value



def _filled(command: str, recipe: str | None) -> list[str]:
    """An example's overrides as a reader fills them in: DIR, FILE and NAME given values, the flags
    (-m, --cfg job) left out, a sweep's first job."""
    overrides = []
    for word in command.split()[3:]:  # after `python -m rltrain`
        if word.startswith("-") or word == "job":
            continue
        key, _, value = word.partition("=")
        value = {"DIR": "/models/mine", "FILE": "/data/mine.jsonl", "NAME": recipe}.get(value, value) or ""
        overrides.append(f"{key}={value.split(',')[0]}")
    return overrides


def test_every_example_composes_with_its_placeholders_filled():
    import re
    from pathlib import Path

    from rltrain.preflight.command_help import EXAMPLES

    recipes = {p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml")}
    for command, note in EXAMPLES:
        named = re.findall(r"\b\w+_\w+\b", note.partition("e.g.")[2])  # recipes an example's note names
        assert set(named) <= recipes and (named or "NAME" not in command), (command, note, sorted(recipes))
        for recipe in named or [None]:
            _composed_with_choices(*_filled(command, recipe))  # raises on an unknown key, group or option
