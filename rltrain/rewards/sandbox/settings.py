"""The code reward's settings in its worker processes, and the sandbox they choose.

A run hands `reward.code` and `reward.sandbox` to its reward workers in one environment variable
(`SETTINGS_ENV`, set only on those workers); outside a run (a reward function called by hand) the
schema's defaults hold. `check` refuses bad values with one paragraph.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from rltrain.config.schema import CodeRewardConfig, RewardConfig, SandboxConfig
from rltrain.rewards.sandbox.base import Sandbox
from rltrain.runtime.errors import UserError

SETTINGS_ENV = "RLTRAIN_CODE_REWARD"


@dataclass
class CodeSettings:
    code: CodeRewardConfig = field(default_factory=CodeRewardConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


def settings_of(reward_cfg: RewardConfig) -> CodeSettings:
    """A run's settings, as plain dataclasses (the config may be an OmegaConf node)."""
    return CodeSettings(
        CodeRewardConfig(**{k: getattr(reward_cfg.code, k) for k in asdict(CodeRewardConfig())}),
        SandboxConfig(**{k: getattr(reward_cfg.sandbox, k) for k in asdict(SandboxConfig())}),
    )


def worker_env(reward_cfg: RewardConfig) -> dict[str, str]:
    """What the run's reward workers get in their environment."""
    return {SETTINGS_ENV: json.dumps(asdict(settings_of(reward_cfg)))}


def current_settings() -> CodeSettings:
    """The settings of this process: its run's, or the defaults."""
    raw = os.environ.get(SETTINGS_ENV)
    if not raw:
        return CodeSettings()
    plain = json.loads(raw)
    return CodeSettings(CodeRewardConfig(**plain["code"]), SandboxConfig(**plain["sandbox"]))


def check(cfg: SandboxConfig) -> None:
    """One paragraph per bad value; bwrap's absence under mode=bwrap is one too."""
    limits = {"workers": cfg.workers, "timeout_s": cfg.timeout_s, "cpu_s": cfg.cpu_s, "memory_mb": cfg.memory_mb,
              "file_size_mb": cfg.file_size_mb, "tmp_mb": cfg.tmp_mb, "processes": cfg.processes, "output_bytes": cfg.output_bytes}
    for key, value in limits.items():
        if value <= 0:
            raise UserError(f"reward.sandbox.{key}={value} must be positive: it bounds what model-written code may use.")
    if cfg.workers > 64:
        raise UserError(f"reward.sandbox.workers={cfg.workers}: at most 64 executions run at once per reward worker.")
    if cfg.mode == "remote" and not cfg.url:
        raise UserError("reward.sandbox.mode=remote needs reward.sandbox.url=http://HOST:PORT, the SandboxFusion service to run the code on.")
    if cfg.mode != "remote" and cfg.python is not None and not os.access(cfg.python, os.X_OK):
        raise UserError(f"reward.sandbox.python={cfg.python!r} is not an executable interpreter; give its path, or null for rltrain's own.")
    if cfg.mode == "bwrap":
        from rltrain.rewards.sandbox.local import works_here

        works_here(cfg)


_sandboxes: dict[str, Sandbox] = {}


def sandbox_for(cfg: SandboxConfig) -> Sandbox:
    """This process's sandbox for `cfg` (built once: the interpreter is probed on first use)."""
    key = json.dumps(asdict(cfg), sort_keys=True)
    if key not in _sandboxes:
        check(cfg)
        from rltrain.rewards.sandbox.local import BwrapSandbox, RlimitsSandbox
        from rltrain.rewards.sandbox.remote import RemoteSandbox

        kinds: dict[str, Callable[[SandboxConfig], Sandbox]] = {"bwrap": BwrapSandbox, "rlimits": RlimitsSandbox, "remote": RemoteSandbox}
        _sandboxes[key] = kinds[cfg.mode](cfg)
    return _sandboxes[key]
