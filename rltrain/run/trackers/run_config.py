"""The composed config as a tracker's run parameters.

W&B takes the nested config as it is; TensorBoard's hparams and MLflow's params are flat
`key -> scalar` maps, so the config is flattened to dotted keys (`algo.lr`, `logger.backends`) with
lists and null kept as their YAML text: the parameters read as the config the run was composed with.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from rltrain.config.schema import Config

Scalar = str | int | float | bool


def config_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain dicts and lists."""
    out = OmegaConf.to_container(cfg, resolve=True)  # a DictConfig: a dict
    assert isinstance(out, dict)
    return out


def flat_config(cfg: Config) -> dict[str, Scalar]:
    """`{dotted key: scalar}`; a list, an empty section or null as its JSON-like text."""
    flat: dict[str, Scalar] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else str(key), value)
        elif isinstance(node, (str, int, float, bool)):
            flat[prefix] = node
        else:
            flat[prefix] = "null" if node is None else str(node)

    walk("", config_dict(cfg))
    return flat
