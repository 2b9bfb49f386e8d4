"""`data=reasoning_gym` checked before any model is built: the package installed (else its install
command), the tasks and their generator configs known to it, an algorithm that takes prompts or
prompt/answer pairs. docs/environments.md, "reasoning-gym"."""

from __future__ import annotations

from rltrain.config.algorithms import spec_of
from rltrain.config.schema import Config
from rltrain.data.reasoning_gym import task_specs
from rltrain.runtime.errors import UserError


def validate_reasoning_gym(cfg: Config) -> None:
    data = cfg.data
    if data.path is not None:
        raise UserError(
            f"data=reasoning_gym generates its prompts from data.tasks, but data.path={data.path!r} names a dataset too. "
            "Drop data.path (or data=reasoning_gym)."
        )
    if spec_of(cfg.algo.name).data in ("preferences", "unpaired"):
        raise UserError(
            f"algo={cfg.algo.name} trains on preference pairs or labelled completions, which reasoning-gym's tasks do not have "
            "(a question and its verifier): use data=reasoning_gym with algo=grpo, ppo or sft."
        )
    task_specs(list(data.tasks), cfg.trainer.seed, data.num_eval)
