"""Config is typed where it is read, so the type checker catches a renamed or misspelt key: every
config parameter in rltrain/ carries its section's dataclass (or the root `Config`), and no code
reads config with `getattr(..., default)` (a default lives in the schema only).

What counts as a config parameter (found by walking the AST of rltrain/):
- a parameter named `cfg` or `*_cfg`;
- a parameter named after a section of the root `Config` (`model`, `data`, `rollout`, ...) whose
  function reads one of that section's keys from it (`model.path`): a `model` that is an
  nn.Module reads none. A Hugging Face model config is named `config`/`hf_config`, never `cfg`.
It counts as untyped when it has no annotation or its annotation mentions `Any`.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from rltrain.config.schema import GROUP_SCHEMAS, Config

PACKAGE = Path(__file__).resolve().parents[3] / "rltrain"
# Untyped config parameters left, each with its reason (none).
UNTYPED_EXCEPTIONS: dict[tuple[str, str, str], str] = {}


def section_keys() -> dict[str, set[str]]:
    """Each root section's keys: its dataclass's fields, or for a group every option's."""
    keys: dict[str, set[str]] = {}
    for f in dataclasses.fields(Config):
        options = GROUP_SCHEMAS.get(f.name, {}).values()
        classes = list(options) or ([f.default_factory] if f.default_factory is not dataclasses.MISSING else [])
        keys[f.name] = {g.name for cls in classes if dataclasses.is_dataclass(cls) for g in dataclasses.fields(cls)}
    return keys


def _reads(function: ast.AST, name: str) -> set[str]:
    return {
        n.attr for n in ast.walk(function)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == name
    }


def config_parameters(tree: ast.AST, keys: dict[str, set[str]]) -> list[tuple[str, str, ast.expr | None]]:
    """(function, parameter, annotation) of every config parameter in `tree`."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = node.args
        for arg in args.posonlyargs + args.args + args.kwonlyargs:
            named_cfg = arg.arg == "cfg" or arg.arg.endswith("_cfg")
            reads_a_section = arg.arg in keys and bool(_reads(node, arg.arg) & keys[arg.arg])
            if named_cfg or reads_a_section:
                found.append((node.name, arg.arg, arg.annotation))
    return found


def untyped(annotation: ast.expr | None) -> bool:
    return annotation is None or "Any" in ast.unparse(annotation)


def _root_name(node: ast.expr) -> tuple[str | None, list[str]]:
    attrs = []
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(node, ast.Attribute):
            attrs.append(node.attr)
        node = node.value if not isinstance(node, ast.Call) else node.func
    return (node.id if isinstance(node, ast.Name) else None), attrs


def getattr_defaults_on_config(tree: ast.AST, keys: dict[str, set[str]]) -> list[int]:
    """Lines of `getattr(x, name, default)` where x is config: rooted in a `cfg`/`*_cfg`/section name,
    or reached through `.cfg`."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            if len(node.args) + len(node.keywords) < 3:
                continue
            root, attrs = _root_name(node.args[0])
            if root is not None and (root == "cfg" or root.endswith("_cfg") or root in keys or "cfg" in attrs):
                lines.append(node.lineno)
    return lines


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield str(path.relative_to(PACKAGE.parent)), ast.parse(path.read_text())


def test_the_counters_find_what_they_look_for():
    keys = section_keys()
    tree = ast.parse(
        "def f(cfg, data_cfg: DataConfig, model, rollout: Any, env):\n"
        "    model.parameters(); rollout.name; env.max_turns; getattr(cfg.rollout, 'process', None)\n"
    )
    params = {(p, untyped(a)) for _, p, a in config_parameters(tree, keys)}
    assert params == {("cfg", True), ("data_cfg", False), ("rollout", True), ("env", True)}
    assert getattr_defaults_on_config(tree, keys) == [2]
    assert "num_threads" in keys["rollout"] and "lr" in keys["optim"]


def test_every_config_parameter_is_typed():
    keys = section_keys()
    found, bad = 0, []
    for path, tree in _modules():
        for function, param, annotation in config_parameters(tree, keys):
            found += 1
            if untyped(annotation) and (path, function, param) not in UNTYPED_EXCEPTIONS:
                bad.append(f"{path}: {function}({param}: {ast.unparse(annotation) if annotation else '?'})")
    assert found > 60, "the walk found too few config parameters: the rule has stopped matching"
    assert not bad, "config parameters untyped or Any (give them their section's dataclass):\n" + "\n".join(bad)


def test_no_config_is_read_with_a_getattr_default():
    keys = section_keys()
    bad = [f"{path}:{line}" for path, tree in _modules() for line in getattr_defaults_on_config(tree, keys)]
    assert not bad, f"getattr with a default on config (narrow with rltrain.config.group_choice): {bad}"


def test_the_run_context_carries_the_root_config():
    from typing import get_type_hints

    from rltrain.config.run_context import RunContext

    assert get_type_hints(RunContext)["cfg"] is Config
