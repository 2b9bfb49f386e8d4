"""The house drawn from its imports: no import cycle anywhere in rltrain/, a root that is a table of
contents, every package opening with what lives there, and module docstrings short enough to read
(the long story is in docs/). docs/architecture.md draws the layout.

Every import counts (module level, inside functions, under TYPE_CHECKING): a cycle hidden behind a
late import still ties two modules into one unit a reader must hold at once.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rltrain"
ROOT_MODULES_MAX = 8
PACKAGE_DOC_LINES = (2, 5)
MODULE_DOC_LINES_MAX = 10


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the rltrain modules it imports (a name imported from a package that is a module of
    it counts as that module)."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".") if is_package else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for target in targets:
                if target.split(".")[0] == "rltrain" and (resolved := resolve(target)) and resolved != mod:
                    edges[mod].add(resolved)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_rltrain():
    mods = modules()
    assert len(mods) > 50, "the package was not found"
    assert cycles(import_graph(mods)) == []


def test_the_root_holds_entry_points_and_packages():
    root_modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root_modules) <= ROOT_MODULES_MAX, root_modules
    packages = [p for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert len(packages) >= 8


def _docstring(path: Path) -> str | None:
    return ast.get_docstring(ast.parse(path.read_text()), clean=False)


def test_every_package_opens_with_what_lives_there():
    lo, hi = PACKAGE_DOC_LINES
    for init in sorted(PACKAGE.rglob("__init__.py")):
        if init.parent == PACKAGE:
            continue  # the root's table of contents may be longer
        doc = _docstring(init)
        assert doc, f"{init.relative_to(PACKAGE.parent)} has no opening docstring"
        assert lo <= len(doc.strip().splitlines()) <= hi, f"{init.relative_to(PACKAGE.parent)}: {lo}-{hi} lines"


def test_module_docstrings_are_short_and_present():
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = _docstring(path)
        assert doc, f"{path.relative_to(PACKAGE.parent)} has no docstring"
        if len(doc.strip().splitlines()) > MODULE_DOC_LINES_MAX:
            long[str(path.relative_to(PACKAGE.parent))] = len(doc.strip().splitlines())
    assert not long, f"module docstrings over {MODULE_DOC_LINES_MAX} lines (move the story to docs/): {long}"


def test_every_test_directory_is_collected():
    """pytest silently skips a directory matching `norecursedirs` (by default `dist` and `build`
    among them): no test directory may match the configured list, or its tests never run."""
    import fnmatch
    import tomllib

    root = PACKAGE.parent
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["norecursedirs"]
    test_dirs = {p.parent for p in (root / "tests").rglob("test_*.py")}
    for directory in sorted(test_dirs):
        for part in directory.relative_to(root).parts:
            hit = [pat for pat in patterns if fnmatch.fnmatch(part, pat)]
            assert not hit, f"{directory} is never collected: '{part}' matches norecursedirs {hit}"
    assert any(d.name == "dist" for d in (root / "tests").iterdir())  # the layer this guards


# What a process imports when it neither generates with vLLM nor trains on Megatron: the launcher,
# an FSDP rank of any algorithm, the transformers engine. vllm and megatron-core take seconds each to
# import (docs/testing.md, "Start-up"), paid by every process that imports them.
LIGHT_PROCESS_MODULES = [
    "rltrain.__main__", "rltrain.worker", "rltrain.launch.local", "rltrain.preflight.validate", "rltrain.run.trainer",
    "rltrain.backends.fsdp.engine", "rltrain.algos.sft", "rltrain.algos.dpo", "rltrain.algos.grpo",
    "rltrain.algos.ppo", "rltrain.rollout.hf", "rltrain.sync",
]


def test_vllm_and_megatron_are_imported_only_where_used():
    import subprocess
    import sys

    code = (
        "import importlib, sys\n"
        f"for name in {LIGHT_PROCESS_MODULES!r}: importlib.import_module(name)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'megatron'}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", f"imported at module level: {proc.stdout.strip()}"


def test_a_spawned_servers_guard_imports_no_torch():
    """The guard (rollout/server/guard.py) only waits beside a spawned server: importing torch would
    cost each server start seconds and the guard hundreds of megabytes."""
    import subprocess
    import sys

    code = "import sys, rltrain.rollout.server.guard; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=PACKAGE.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", f"the guard imports: {proc.stdout.strip()}"


# The packages from the bottom up (docs/architecture.md, "Layers"): a module imports only from its own
# package and from packages below it; the entry modules at the root (__main__, worker, plot) sit on top.
LAYERS = [
    "runtime",  # processes, collectives, errors: imports no other package
    "safety",  # guarded steps, metric reduction, faults, health: on runtime alone, so RunContext holds a run's faults
    "config",  # the schema every layer reads, RunContext, Hub ids
    "launch",  # starts ranks by command line, never by import
    "models",
    "data",
    "transport",  # weights, and bounded JSON requests over HTTP, across a process boundary
    "backends",
    "rollout",
    "sync",  # when weights move between the two above
    "rewards",
    "envs",
    "run",  # the loop and its services (samples, evaluation, metrics, checkpoints, safety); algorithms by name
    "algos",
    "preflight",  # the launcher's checks and help, before a run exists: above every package it checks
]
# Imports that point up, each with why moving the code would be worse (none: keep it empty).
UPWARD_IMPORTS: dict[tuple[str, str], str] = {}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def upward_imports(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs whose imported package sits above the importer's in LAYERS."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    found = []
    for mod, targets in sorted(edges.items()):
        low = package_of(mod)
        if low is None:
            continue  # an entry module at the root
        for target in sorted(targets):
            high = package_of(target)
            if high is not None and high != low and rank[high] > rank[low]:
                found.append((mod, target))
    return found


def test_the_layer_check_finds_an_upward_import():
    assert upward_imports({"rltrain.runtime.errors": {"rltrain.config.schema"}}) == [
        ("rltrain.runtime.errors", "rltrain.config.schema")
    ]
    assert upward_imports({"rltrain.algos.rl.algorithm": {"rltrain.runtime.errors"}, "rltrain.__main__": {"rltrain.algos"}}) == []


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(LAYERS), f"place each package in LAYERS: {sorted(packages ^ set(LAYERS))}"


def test_imports_point_down_the_layers():
    found = upward_imports(import_graph(modules()))
    unexplained = [pair for pair in found if pair not in UPWARD_IMPORTS]
    assert not unexplained, "imports from a lower package to a higher one (LAYERS):\n" + "\n".join(
        f"  {a} -> {b}" for a, b in unexplained
    )
    stale = sorted(set(UPWARD_IMPORTS) - set(found))
    assert not stale, f"UPWARD_IMPORTS lists imports that no longer exist: {stale}"
