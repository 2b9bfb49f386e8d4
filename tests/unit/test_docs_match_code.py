"""The README and every docs/*.md page against the code they describe.

The docs name config keys and their defaults, config groups and their options, repository files,
test functions, modules and metric keys. Each name is checked here against what exists (the
composed Hydra config, `conf/`, the repository tree, the source of `rltrain/`), so a rename, a new
option or a changed default that the docs do not follow fails this test instead of misleading a
user. Each check runs over the README and every page of docs/, collects every mismatch and
reports them all at once, with the page and line.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, ListConfig, OmegaConf

from rltrain.__main__ import CONF_DIR
from rltrain.config.schema import register_configs

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS_DIR = ROOT / "docs"
ARCHITECTURE = DOCS_DIR / "architecture.md"
# The page whose "## Metrics" section names the safety metrics.
METRICS_PAGE = DOCS_DIR / "failure-behaviour.md"
CONF = Path(CONF_DIR)

# A default cell that says the value depends on something else, instead of giving it.
PROSE_DEFAULTS = {"per algorithm"}

# First segments of the metric keys the run logs (`metrics.jsonl`, W&B).
METRIC_NAMESPACES = (
    "eval",
    "reward",
    "rollout",
    "critic",
    "policy",
    "adv",
    "safety",
    "moe",
    "time",
    "mem",
    "data",
    "samples",
    "env",
)

# Top-level folders of the repository that the docs name paths under.
REPO_DIRS = ("rltrain", "tests", "scripts", "conf", "docs", "requirements")

MISSING_KEY = object()


# --- reading the docs -------------------------------------------------------------------------


def doc_pages() -> list[Path]:
    """The README and every page of docs/ (docs/**/*.md, internals included), the pages every check reads."""
    return [README, *sorted(DOCS_DIR.rglob("*.md"))]


def label(path: Path) -> str:
    """`path` as the reports name it: relative to the repository, or its name when outside."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def numbered_lines(path: Path) -> list[tuple[int, str]]:
    return list(enumerate(path.read_text().splitlines(), start=1))


def section(path: Path, heading: str) -> list[tuple[int, str]]:
    """The lines under `heading` (e.g. "## Configuration") up to the next heading of its level or
    above; fenced code is skipped so that a `# comment` in a shell block is not a heading."""
    level = heading.split(" ")[0]
    lines = numbered_lines(path)
    start = next(i for i, (_, text) in enumerate(lines) if text.strip() == heading)
    body: list[tuple[int, str]] = []
    in_fence = False
    for number, text in lines[start + 1 :]:
        if text.startswith("```"):
            in_fence = not in_fence
        heading_match = re.match(r"(#+) ", text)
        if not in_fence and heading_match and len(heading_match.group(1)) <= len(level):
            break
        body.append((number, text))
    return body


def backticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def table_cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def key_table_rows(path: Path) -> list[tuple[int, list[str], str | None, str]]:
    """Rows of every table whose header starts with `key`: (line, keys, override, value cell).

    The header's second column is `default` (values of `python -m rltrain` as composed) or a
    backticked override such as `model=tiny_sft` (values under that group choice). Keys are the
    first cell's backticked names; `.name` continues the section of the key before it
    (`reward_model.weight` / `.batch_size`).
    """
    rows = []
    override: str | None = None
    in_key_table = False
    for number, line in numbered_lines(path):
        if not line.startswith("|"):
            in_key_table = False
            continue
        cells = table_cells(line)
        if cells[0] == "key":
            in_key_table = True
            header = backticked(cells[1])
            override = header[0] if header else None
            continue
        if not in_key_table or set(cells[0]) <= {"-", " "}:
            continue
        keys: list[str] = []
        for name in backticked(cells[0]):
            keys.append(keys[-1].rsplit(".", 1)[0] + name if name.startswith(".") else name)
        rows.append((number, keys, override, cells[1]))
    return rows


def parse_literal(text: str) -> Any:
    text = text.strip().strip("`")
    if text == "null":
        return None
    if text in ("true", "false"):
        return text == "true"
    try:
        return float(text)
    except ValueError:
        return text


def parse_value_cell(cell: str) -> tuple[list[Any] | None, dict[str, list[Any]]]:
    """A value cell: `v1 / v2 ...` or prose from PROSE_DEFAULTS, then optional `(`group=option`: v1 / ...)`
    remarks giving the values under another group choice. Returns (values or None for prose,
    {override: values}). Anything else raises, so a new kind of cell is looked at, not skipped."""
    remarks = {
        override: [parse_literal(v) for v in values.split(" / ")]
        for override, values in re.findall(r"\(`([\w.]+=[\w.]+)`: ([^)]*)\)", cell)
    }
    main = re.sub(r"\s*\(`[\w.]+=[\w.]+`: [^)]*\)", "", cell).strip()
    if main in PROSE_DEFAULTS:
        return None, remarks
    values = main.split(" / ")
    if not all(re.fullmatch(r"`[^`]+`|null|true|false|[-+\d.e]+", v.strip()) for v in values):
        raise ValueError(
            f"unreadable value cell {cell!r}: write `v1 / v2` (+ `(`group=option`: ...)`) or one of {PROSE_DEFAULTS}"
        )
    return [parse_literal(v) for v in values], remarks


# --- the code's side ------------------------------------------------------------------------


def group_options() -> dict[str, set[str]]:
    """Hydra config groups of the run (`conf/<group>/<option>.yaml`); Hydra's own `hydra/` is not one."""
    return {
        folder.name: {option.stem for option in folder.glob("*.yaml")}
        for folder in CONF.iterdir()
        if folder.is_dir() and folder.name != "hydra"
    }


@functools.cache
def composed(*overrides: str) -> DictConfig:
    """The config `python -m rltrain *overrides` composes (with `hydra.runtime.choices`)."""
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def config_value(key: str, *overrides: str) -> Any:
    """`key` in the composed config; a group name gives its chosen option; MISSING_KEY when absent."""
    cfg = composed(*overrides)
    if key in group_options():
        return cfg.hydra.runtime.choices[key]
    return OmegaConf.select(cfg, key, default=MISSING_KEY)


def value_for(key: str, overrides: tuple[str, ...]) -> Any:
    """`key` under `overrides`; with none, the default composition, else the first option of the
    key's group that has it (`algo.gamma` exists only with `algo=ppo`)."""
    if overrides:
        return config_value(key, *overrides)
    value = config_value(key)
    group = key.split(".")[0]
    if value is MISSING_KEY and group in group_options():
        for option in sorted(group_options()[group]):
            value = config_value(key, f"{group}={option}")
            if value is not MISSING_KEY:
                break
    return value


def same_value(doc: Any, code: Any) -> bool:
    if isinstance(code, list | ListConfig):  # documented as a Hydra override writes it: [a,b]
        return doc == "[" + ",".join(str(v) for v in code) + "]"
    if isinstance(code, bool) or code is None or isinstance(doc, str):
        return doc == code
    return isinstance(code, int | float) and float(doc) == float(code)


@functools.cache
def rltrain_source() -> str:
    return "\n".join(path.read_text() for path in sorted((ROOT / "rltrain").rglob("*.py")))


def defined_in(path: Path, name: str) -> bool:
    """`name` is a function, class or module-level variable of the Python file `path`."""
    pattern = rf"^\s*(?:async\s+def|def|class)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]"
    return re.search(pattern, path.read_text(), re.MULTILINE) is not None


# --- the checks -----------------------------------------------------------------------------


def test_every_key_in_the_tables_exists_with_the_default_given():
    problems = []
    rows = [(doc, row) for doc in doc_pages() for row in key_table_rows(doc)]
    for doc, (number, keys, override, cell) in rows:
        where = f"{label(doc)}:{number}"
        overrides = (override,) if override else ()
        for key in keys:
            if value_for(key, overrides) is MISSING_KEY:
                problems.append(f"{where}: `{key}` is not a config key (rltrain/config/schema.py, conf/)")
        try:
            values, remarks = parse_value_cell(cell)
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
            continue
        for value_overrides, doc_values in [(overrides, values), *(((o,), v) for o, v in remarks.items())]:
            if doc_values is None:
                continue
            if len(doc_values) != len(keys):
                problems.append(f"{where}: {len(doc_values)} values {doc_values} for {len(keys)} keys {keys}")
                continue
            for key, doc in zip(keys, doc_values, strict=True):
                code = value_for(key, value_overrides)
                if code is not MISSING_KEY and not same_value(doc, code):
                    run = " ".join(("python -m rltrain", *value_overrides))
                    problems.append(f"{where}: `{key}` is documented as {doc!r}, `{run}` composes {code!r}")
    assert not problems, "key tables in the docs disagree with the config:\n" + "\n".join(problems)


GROUPS_OPENING = "Groups (pick one per group"


def groups_paragraphs(path: Path) -> list[tuple[int, str]]:
    """Every paragraph of `path` that lists the config groups (starts with GROUPS_OPENING)."""
    lines = numbered_lines(path)
    found = []
    for i, (number, text) in enumerate(lines):
        if not text.startswith(GROUPS_OPENING):
            continue
        paragraph = []
        for _, line in lines[i:]:
            if not line.strip():
                break
            paragraph.append(line)
        found.append((number, " ".join(paragraph)))
    return found


def test_the_groups_listed_are_the_conf_folders_with_their_options():
    assert groups_paragraphs(README), f"README.md must list the config groups ({GROUPS_OPENING} ...)"
    problems = [
        f"{label(doc)}:{number} (Groups ...): {problem}"
        for doc in doc_pages()
        for number, paragraph in groups_paragraphs(doc)
        for problem in groups_problems(paragraph)
    ]
    assert not problems, "config groups in the docs:\n" + "\n".join(problems)


def groups_problems(paragraph: str) -> list[str]:
    groups_text, plain_text = paragraph.split("Plain sections:", 1)
    documented: dict[str, set[str] | None] = {}
    for group, options in re.findall(r"`(\w+)`(?: \(((?:`\w+`(?:, )?)+)\))?", groups_text):
        documented[group] = set(backticked(options)) if options else None
    actual = group_options()
    problems = []
    if set(documented) != set(actual):
        problems.append(f"groups named {sorted(documented)}, conf/ has {sorted(actual)}")
    for group, options in documented.items():
        if group not in actual:
            continue
        if options is None and len(actual[group]) > 1:
            problems.append(f"`{group}` has options {sorted(actual[group])}: list them")
        elif options is not None and options != actual[group]:
            problems.append(f"`{group}` lists {sorted(options)}, conf/{group}/ has {sorted(actual[group])}")
    plain_sections = set(backticked(plain_text.split(".", 1)[0]))
    top_level = set(composed().keys()) - set(actual) - {"hydra"}
    if plain_sections != top_level:
        problems.append(f"plain sections named {sorted(plain_sections)}, the config has {sorted(top_level)}")
    return problems


def mentioned_paths(path: Path) -> list[tuple[int, str]]:
    """Repository paths named in `path`'s text (`rltrain/x.py`, `tests/y.py::test_z`, `conf/...`)."""
    pattern = rf"(?<![\w./-])((?:{'|'.join(REPO_DIRS)})/[\w./*-]*(?:::\w+(?:\[[^\]]*\])?)?)"
    found = []
    for number, line in numbered_lines(path):
        for match in re.findall(pattern, line):
            found.append((number, match.rstrip(".")))
    return found


def path_problem(mention: str) -> str | None:
    file_part, _, test_name = mention.partition("::")
    matches = sorted(ROOT.glob(file_part.rstrip("/"))) if "*" in file_part else [ROOT / file_part.rstrip("/")]
    if not matches or not all(m.exists() for m in matches):
        return f"`{file_part}` does not exist"
    if file_part.endswith("/") and not matches[0].is_dir():
        return f"`{file_part}` is not a directory"
    if test_name:
        name = test_name.split("[", 1)[0]
        if not defined_in(matches[0], name):
            return f"`{file_part}` has no `{name}`"
    return None


def layout_block_problems() -> list[str]:
    """docs/architecture.md's package layout: each entry's path exists, and the files an entry for
    a folder names (`base.py`, `transport*.py`) exist under that folder."""
    problems = []
    folder: Path | None = None
    for number, line in section(ARCHITECTURE, "## Package layout"):
        if not line.startswith("    "):
            continue
        entry = re.match(r"    ((?:rltrain|scripts)/\S*)", line)
        if entry:
            folder = ROOT / entry.group(1) if entry.group(1).endswith("/") else None
        if folder is None:
            continue
        description = line[entry.end() :] if entry else line
        for name in re.findall(r"(?<![\w./-])([\w*]+\.py)\b", description):
            if not any(fnmatch.fnmatch(p.name, name) for p in folder.rglob("*.py")):
                problems.append(
                    f"docs/architecture.md:{number}: `{name}` is not under {folder.relative_to(ROOT)}/"
                )
    return problems


def test_every_path_and_test_named_in_the_docs_exists():
    problems = []
    for doc in doc_pages():
        for number, mention in mentioned_paths(doc):
            problem = path_problem(mention)
            if problem:
                problems.append(f"{label(doc)}:{number}: {problem}")
    problems += layout_block_problems()
    assert not problems, "paths named in the docs:\n" + "\n".join(problems)


def test_every_test_function_and_module_attribute_named_in_the_docs_exists():
    """Bare test names (`test_bf16_mixed_tracks_fp32`, in the GPU table) and dotted names
    (`rltrain.runtime.distributed.isend`, `rltrain.rewards.builtin:exact_match`)."""
    test_files = sorted((ROOT / "tests").rglob("test_*.py"))
    problems = []
    for doc, number, line in doc_lines():
        for token in backticked(line):
            bare_test = re.fullmatch(r"(test_\w+)(?:\[[^\]]*\])?", token)
            if bare_test and not any(defined_in(f, bare_test.group(1)) for f in test_files):
                problems.append(f"{label(doc)}:{number}: no test function `{bare_test.group(1)}` in tests/")
            for dotted in re.findall(r"\brltrain(?:\.\w+)+(?::\w+)?", token):
                problem = dotted_name_problem(dotted)
                if problem:
                    problems.append(f"{label(doc)}:{number}: {problem}")
    assert not problems, "names in the docs:\n" + "\n".join(problems)


def doc_lines() -> list[tuple[Path, int, str]]:
    """(page, line number, text) for every line of every page."""
    return [(doc, number, line) for doc in doc_pages() for number, line in numbered_lines(doc)]


def test_every_make_target_named_in_the_docs_exists():
    """`make X` in backticks or starting a line of a code block."""
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    problems = [
        f"{label(doc)}:{number}: `make {target}` is not a Makefile target"
        for doc, number, line in doc_lines()
        for target in re.findall(r"(?:^|`)make ([a-z][\w-]*)", line)
        if target not in targets
    ]
    assert not problems, "make targets in the docs:\n" + "\n".join(problems)


def dotted_name_problem(dotted: str) -> str | None:
    """`rltrain.a.b[.attr]` or `rltrain.a.b:attr`: the longest module prefix is a file, and the
    rest (at most one name) is defined in it."""
    parts = dotted.replace(":", ".").split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = parts[cut:]
            if len(rest) > 1:
                return f"`{dotted}`: {module.relative_to(ROOT)} has no submodule `{rest[0]}`"
            if rest and not defined_in(module, rest[0]):
                return f"`{dotted}`: {module.relative_to(ROOT)} defines no `{rest[0]}`"
            return None
    return f"`{dotted}`: no such module"


def metric_key_pattern(key: str) -> re.Pattern[str]:
    """A documented key as it can appear in source: `reward/<name>` (or `eval/*`) stands for any
    name, written in the source as `<name>`, `*`, an f-string field `{name}` or a word."""
    placeholder = r"(?:<\w+>|\*|\{[^}]*\}|\w+)"
    parts = re.split(r"<\w+>|\*|\.\.\.", key)
    body = placeholder.join(re.escape(part) for part in parts)
    return re.compile(rf"(?<![\w/]){body}(?![\w/])")


def built_by_an_fstring(key: str) -> bool:
    """`key` is what an f-string in rltrain/ makes when its fields take values that are string
    literals there too: `time/phase/generate` from `f"time/phase/{name}"` and `"generate"`."""
    source = rltrain_source()
    for template in re.findall(r"\bf\"([^\"\n]*\{[^\"\n]*)\"", source):
        fields = re.split(r"\{[^}]*\}", template)
        match = re.fullmatch(r"(\w+)".join(re.escape(part) for part in fields), key)
        if match and all(re.search(rf"[\"']{value}[\"']", source) for value in match.groups()):
            return True
    return False


def test_every_metric_key_in_the_docs_is_in_the_code():
    problems = []
    keys_pattern = rf"^(?:{'|'.join(METRIC_NAMESPACES)})/[\w<>*./]+$"
    for doc, number, line in doc_lines():
        for token in backticked(line):
            if not re.fullmatch(keys_pattern, token):
                continue
            if not metric_key_pattern(token).search(rltrain_source()) and not built_by_an_fstring(token):
                problems.append(f"{label(doc)}:{number}: `{token}` appears nowhere in rltrain/")
    assert not problems, "metric keys in the docs:\n" + "\n".join(problems)


def test_the_metrics_section_names_keys():
    """The "## Metrics" section of failure-behaviour.md must keep naming its keys, or the check above
    checks nothing there."""
    keys = [t for _, line in section(METRICS_PAGE, "## Metrics") for t in backticked(line) if "/" in t]
    assert {"safety/recovered_errors", "safety/skipped_steps"} <= set(keys)


@pytest.mark.parametrize(
    ("cell", "values", "remarks"),
    [
        ("64 / 128 (`algo=sft`: 64 / 64)", [64.0, 128.0], {"algo=sft": [64.0, 64.0]}),
        ("`auto`", ["auto"], {}),
        ("per algorithm", None, {}),
        ("null / 1e-3", [None, 1e-3], {}),
    ],
)
def test_value_cells_parse(cell, values, remarks):
    assert parse_value_cell(cell) == (values, remarks)


def test_a_prose_value_cell_is_refused():
    with pytest.raises(ValueError, match="unreadable value cell"):
        parse_value_cell("depends on the model")


def test_a_wrong_default_is_reported(tmp_path, monkeypatch):
    """The table check against a README whose default is wrong and whose key does not exist."""
    fake = tmp_path / "README.md"
    fake.write_text(
        "| key | default | meaning |\n| --- | --- | --- |\n"
        "| `trainer.seed` / `trainer.nproc` | 0 / 2 | x |\n| `trainer.max_stepz` | 5 | x |\n"
    )
    monkeypatch.setitem(globals(), "README", fake)
    monkeypatch.setitem(globals(), "DOCS_DIR", tmp_path / "no_docs")
    with pytest.raises(AssertionError) as failure:
        test_every_key_in_the_tables_exists_with_the_default_given()
    assert "README.md:3: `trainer.nproc` is documented as 2.0, `python -m rltrain` composes 1" in str(
        failure.value
    )
    assert "`trainer.max_stepz` is not a config key" in str(failure.value)


def test_the_groups_check_reports_a_missing_option_and_section(tmp_path, monkeypatch):
    fake = tmp_path / "README.md"
    fake.write_text(
        "## Configuration\n\nGroups (pick one per group on the command line): `algo` (`sft`, `dpo`, `grpo`),\n"
        "`backend` (`fsdp`, `megatron`), `rollout` (`vllm`, `hf`), `model` (`tiny`, `tiny_sft`), `reference`,\n"
        "`critic`, `reward_model` (`none`, `hf`), `data`, `logger`. Plain sections: `trainer`, `optim`.\n"
    )
    monkeypatch.setitem(globals(), "README", fake)
    monkeypatch.setitem(globals(), "DOCS_DIR", tmp_path / "no_docs")
    with pytest.raises(AssertionError) as failure:
        test_the_groups_listed_are_the_conf_folders_with_their_options()
    assert "`algo` lists ['dpo', 'grpo', 'sft'], conf/algo/ has ['dpo', 'grpo', 'orpo', 'ppo', 'sft', 'simpo']" in str(
        failure.value
    )
    assert "plain sections named ['optim', 'trainer']" in str(failure.value)


def test_the_layout_check_reports_a_file_that_is_not_there(tmp_path, monkeypatch):
    fake = tmp_path / "architecture.md"
    fake.write_text("## Package layout\n\n    rltrain/algos/   base.py, sft.py (+no_such_loss.py)\n")
    monkeypatch.setitem(globals(), "ARCHITECTURE", fake)
    assert layout_block_problems() == [
        "docs/architecture.md:3: `no_such_loss.py` is not under rltrain/algos/"
    ]


def test_missing_paths_names_and_metrics_are_found():
    assert path_problem("rltrain/no_such_module.py") == "`rltrain/no_such_module.py` does not exist"
    assert (
        path_problem("tests/unit/backends/test_roles.py::test_no_such_test")
        == "`tests/unit/backends/test_roles.py` has no `test_no_such_test`"
    )
    assert path_problem("scripts/no_such_*.py") == "`scripts/no_such_*.py` does not exist"
    assert (
        path_problem("tests/unit/test_docs_match_code.py::test_missing_paths_names_and_metrics_are_found")
        is None
    )
    assert dotted_name_problem("rltrain.runtime.distributed.no_such_helper") is not None
    assert dotted_name_problem("rltrain.rewards.builtin:exact_match") is None
    assert built_by_an_fstring("time/phase/generate") and not built_by_an_fstring("time/phase/no_such_phase")
    assert not metric_key_pattern("critic/no_such_metric").search(rltrain_source())


def test_every_docs_page_is_checked():
    """The pages the README links to are among those the checks read."""
    pages = {label(p) for p in doc_pages()}
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)", README.read_text()))
    assert linked and linked <= pages, sorted(linked - pages)


def test_a_docs_page_is_checked_like_the_readme(tmp_path, monkeypatch):
    """A page of docs/ with a wrong default, a missing file and a missing test is reported by name."""
    readme = tmp_path / "README.md"
    readme.write_text("nothing to check\n")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "page.md").write_text(
        "| key | default | meaning |\n| --- | --- | --- |\n| `trainer.nproc` | 2 | x |\n\n"
        "See `rltrain/no_such_module.py` and `test_no_such_test_anywhere`.\n"
    )
    monkeypatch.setitem(globals(), "README", readme)
    monkeypatch.setitem(globals(), "DOCS_DIR", docs)
    with pytest.raises(AssertionError, match=r"page\.md:3: `trainer\.nproc` is documented as 2\.0"):
        test_every_key_in_the_tables_exists_with_the_default_given()
    with pytest.raises(AssertionError, match=r"page\.md:5: no test function `test_no_such_test_anywhere`"):
        test_every_test_function_and_module_attribute_named_in_the_docs_exists()
    problems = [path_problem(mention) for _, mention in mentioned_paths(docs / "page.md")]
    assert problems == ["`rltrain/no_such_module.py` does not exist"]
