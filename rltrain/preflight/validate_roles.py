"""The roles' checks (docs/rewards-and-roles.md, "Roles"): `reference`, `critic`, `teacher` and
`reward_model` each a usable model for an algorithm that builds it, and a reward model's directory
one that loads as a reward model. rltrain/preflight/validate.py calls `validate_roles` with the rest.
"""

from __future__ import annotations

import math

from rltrain.backends.sequence_classifier import REWARD_HEAD_KEY, is_vision_reward_config
from rltrain.config.algorithms import names_where, spec_of
from rltrain.config.schema import Config
from rltrain.preflight.sources import check_revision, read_hf_config, validate_model_source
from rltrain.runtime.errors import UserError


def validate_roles(cfg: Config) -> None:
    """`reference`, `critic` and `reward_model` (docs/rewards-and-roles.md, "Roles"): each path a usable Hugging Face
    directory, each number in range, and no role configured that the algorithm would not build.
    That a role's tokenizer is the policy's is checked once the policy's directory exists
    (rltrain/backends/roles.py)."""
    validate_model_source("reference", cfg.reference, "leave it null for the policy's initial weights")
    validate_model_source("critic", cfg.critic, "leave it null for the policy's weights with a fresh value head")
    if not cfg.critic.lr > 0:
        raise UserError(f"critic.lr={cfg.critic.lr} must be positive (the critic's own learning rate).")
    algo = cfg.algo
    spec = spec_of(algo.name)
    if cfg.reference.path is not None and not spec.builds_reference(algo):
        when_beta = spec.reference == "when_beta"
        why = f"algo={algo.name} builds a reference only when algo.beta > 0" if when_beta else f"algo={algo.name} has no reference"
        raise UserError(
            f"reference.path={cfg.reference.path!r} is set but would be unused: {why}. Remove reference.path"
            + (", or set algo.beta (e.g. algo.beta=0.04) to add the KL penalty." if when_beta else ".")
        )
    if cfg.critic.path is not None and not spec.critic:
        with_critic = " and ".join(n.upper() for n in names_where(lambda s: s.critic))
        raise UserError(
            f"critic.path={cfg.critic.path!r} is set but algo={algo.name} has no critic (only {with_critic} trains one). "
            "Remove critic.path, or choose an algorithm with a critic."
        )
    validate_model_source("teacher", cfg.teacher, "leave it null unless algo=distill")
    if cfg.teacher.path is not None and not spec.teacher:
        with_teacher = " or ".join(f"algo={n}" for n in names_where(lambda s: s.teacher))
        raise UserError(
            f"teacher.path={cfg.teacher.path!r} is set but algo={algo.name} has no teacher ({with_teacher} distils from "
            "one). Remove teacher.path, or choose that algorithm."
        )
    if spec.teacher and cfg.teacher.path is None:
        raise UserError(
            f"algo={algo.name} needs teacher.path: the Hugging Face model (a directory or a Hub id) whose tokens the "
            "policy learns to match, sharing the policy's tokenizer; e.g. teacher.path=outputs/.../final from a GRPO run."
        )
    validate_reward_model(cfg.reward_model, algo.name)


def validate_reward_model(rm, algo_name: str) -> None:
    if rm.name == "none":
        if rm.path is not None:
            raise UserError(
                f"reward_model.path={rm.path!r} is set but reward_model=none scores nothing. Add reward_model=hf "
                "to the command line to use it, or remove reward_model.path."
            )
        return
    if not spec_of(algo_name).rewards:
        scored = " and ".join(n.upper() for n in names_where(lambda s: s.rewards))
        raise UserError(
            f"reward_model={rm.name} is set but algo={algo_name} uses no rewards ({scored} do). Remove reward_model={rm.name}."
        )
    if rm.name == "judge":
        from rltrain.rewards.judge.build import check_judge

        check_judge(rm)
        if not math.isfinite(rm.weight):
            raise UserError(f"reward_model.weight={rm.weight} must be a finite number (its factor in the total reward).")
        check_revision("reward_model", rm)
        if rm.path is not None:  # a causal LM the run serves: its directory must be a model's
            read_hf_config("reward_model.path", rm.path, "give reward_model.url for an endpoint instead", rm.revision)
        return
    if rm.path is None:
        raise UserError(
            "reward_model=hf needs reward_model.path: a Hugging Face AutoModelForSequenceClassification directory "
            "with one output (num_labels=1) and its tokenizer, e.g. reward_model.path=/models/my-reward-model. "
            "Or drop reward_model=hf to score with reward.fns alone."
        )
    check_revision("reward_model", rm)
    hf_config = read_hf_config("reward_model.path", rm.path, "use reward_model=none", rm.revision)
    check_reward_model_config(rm.path, hf_config)
    if not math.isfinite(rm.weight):
        raise UserError(f"reward_model.weight={rm.weight} must be a finite number (its factor in the total reward).")
    for key in ("batch_size", "max_length"):
        if getattr(rm, key) < 1:
            raise UserError(f"reward_model.{key}={getattr(rm, key)} must be at least 1.")


def check_reward_model_config(path: str, hf_config: dict) -> None:
    """A one-output sequence classifier, or a vision-language reward model (algo=rm's final/: the
    model plus `score.safetensors`, docs/vision.md)."""
    if is_vision_reward_config(hf_config):
        return
    architectures = hf_config.get("architectures") or []
    if "vision_config" in hf_config:
        raise UserError(
            f"reward_model.path={path!r} is a vision-language model without a reward head (its config.json has no "
            f"{REWARD_HEAD_KEY!r}): loaded as a reward model, its head would be freshly random. Give the final/ of an "
            "algo=rm run on that model (the model plus score.safetensors) (docs/vision.md)."
        )
    if not any(str(name).endswith("ForSequenceClassification") for name in architectures):
        raise UserError(
            f"reward_model.path={path!r} is not a sequence classifier (its config.json lists architectures "
            f"{architectures}): loaded as one, its score head would be freshly random. Give a model saved from "
            "AutoModelForSequenceClassification with num_labels=1, or a vision-language reward model (algo=rm's final/)."
        )
    labels = len(hf_config.get("id2label") or {}) or int(hf_config.get("num_labels", 2))
    if labels != 1:
        raise UserError(
            f"reward_model.path={path!r} has {labels} output labels; a reward model gives one score per text "
            "(num_labels=1). Use a reward model, not a multi-class classifier."
        )
