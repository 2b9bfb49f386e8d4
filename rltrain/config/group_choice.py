"""A group's chosen option read as its own dataclass. The root `Config` types the groups whose option
varies (algo, backend, rollout, reward_model, env) by their base; a key only some options have is
read after narrowing here, by the option's `name` and `GROUP_SCHEMAS`, never by `getattr` with a
default. The node stays an OmegaConf node (a rank's config.yaml carries no dataclass type).
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

from rltrain.config.schema import GROUP_SCHEMAS

T = TypeVar("T")


def as_option(group: str, node: Any, schema: type[T]) -> T | None:
    """`node` (the option chosen for `group`, or None) typed as `schema` when that option's schema is
    `schema` or a subclass of it; None otherwise."""
    if node is None:
        return None
    option = GROUP_SCHEMAS[group].get(node.name)
    return cast(T, node) if option is not None and issubclass(option, schema) else None
