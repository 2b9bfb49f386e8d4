"""The roles of a run (policy, reference, critic, teacher) and where each one's engine comes from.

One module decides each role's weights, head and optimizer, and checks that a reference, critic or
teacher shares the policy's tokenizer, since it scores the policy's token ids. docs/internals/backends.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypedDict

from omegaconf import OmegaConf

from rltrain.config.algorithms import spec_of
from rltrain.config.group_options import CriticConfig, ReferenceConfig, TeacherConfig
from rltrain.config.run_context import RunContext
from rltrain.config.schema import Config, SafetyConfig
from rltrain.runtime.errors import UserError
from rltrain.runtime.precision import Precision
from rltrain.safety.faults import FaultInjector

Role = Literal["policy", "reference", "critic", "teacher"]
ROLES: tuple[Role, ...] = ("policy", "reference", "critic", "teacher")

# Text whose split into tokens must agree: letters, digits, punctuation, spaces and a newline, so
# that tokenizers with one vocabulary but different normalisation or merges are told apart.
PROBE_TEXT = "Q: 12+34=? A: 46.\n  The quick brown fox, jumps over (the) lazy dog!"


def resolve_role_dirs(cfg: Config, policy_dir: Path, policy_tokenizer: Any, rank: int) -> dict[str, Path]:
    """The directory of every role given a path of its own, each checked to be readable on this
    rank and to share the policy's tokenizer."""
    from rltrain.config.hub import local_model_dir

    groups: dict[str, ReferenceConfig | CriticConfig | TeacherConfig] = {
        "reference": cfg.reference, "critic": cfg.critic, "teacher": cfg.teacher,
    }
    dirs: dict[str, Path] = {}
    for role, group in groups.items():
        key, value = f"{role}.path", group.path
        if value is None:
            continue
        directory = local_model_dir(key, value, group.revision).resolve()
        if not (directory / "config.json").is_file():
            raise UserError(
                f"{key}={value!r} has no config.json on rank {rank}: every rank reads the {role}'s model "
                "itself. Put the directory where every machine of the run can read it (a shared filesystem), "
                "or copy it to the same path on each."
            )
        check_same_tokenizer(key, directory, policy_dir, policy_tokenizer)
        dirs[role] = directory
    return dirs


def check_same_tokenizer(key: str, role_dir: Path, policy_dir: Path, policy_tokenizer: Any) -> None:
    """UserError naming both directories unless the tokenizer at `role_dir` is the policy's."""
    from rltrain.models.tokenizer import load_tokenizer

    role_tokenizer = load_tokenizer(role_dir)
    difference = tokenizer_difference(policy_tokenizer, role_tokenizer)
    if difference:
        raise UserError(
            f"{key}={str(role_dir)!r} has a different tokenizer from the policy's ({policy_dir}): {difference}. "
            f"The {key.split('.')[0]} scores the policy's token ids, so both must use one tokenizer. Point {key} "
            "at a model trained with the policy's tokenizer, or leave it null to start from the policy's weights."
        )


def tokenizer_difference(policy: Any, other: Any) -> str:
    """What differs between two tokenizers, in words; "" when they are the same."""
    vocab_p, vocab_o = policy.get_vocab(), other.get_vocab()
    if vocab_p != vocab_o:
        if len(vocab_p) != len(vocab_o):
            return f"the vocabularies have {len(vocab_p)} and {len(vocab_o)} tokens"
        moved = sorted(tok for tok in vocab_p if vocab_o.get(tok) != vocab_p[tok])
        sample = ", ".join(f"{tok!r} is {vocab_p[tok]} vs {vocab_o.get(tok)}" for tok in moved[:3])
        return f"{len(moved)} tokens have other ids or are missing ({sample})"
    specials_p, specials_o = policy.special_tokens_map, other.special_tokens_map
    if specials_p != specials_o:
        names = sorted(k for k in set(specials_p) | set(specials_o) if specials_p.get(k) != specials_o.get(k))
        detail = "; ".join(f"{name}: {specials_p.get(name)!r} vs {specials_o.get(name)!r}" for name in names)
        return f"the special tokens differ ({detail})"
    ids_p, ids_o = policy.encode(PROBE_TEXT), other.encode(PROBE_TEXT)
    if ids_p != ids_o:
        return f"the same text splits into different tokens ({PROBE_TEXT!r}: {len(ids_p)} vs {len(ids_o)} tokens)"
    return ""


@dataclass(frozen=True)
class RoleBuild:
    model_dir: Path
    optim: Any | None  # an OptimConfig-shaped node; None builds a frozen engine
    value_head_seed: int | None  # a critic's head seed; None scores log-probabilities (LM head)
    adapters: Any | None = None  # the policy's LoRA settings (model.lora); None trains every weight
    # False: a reward model's head, bias-free like the score layer of a Hugging Face sequence
    # classifier, so that it is exported exactly (a critic's head keeps its bias).
    value_head_bias: bool = True


class EngineOptions(TypedDict):
    precision: Precision | str
    safety: SafetyConfig
    gradient_checkpointing: bool
    value_head_seed: int | None
    value_head_bias: bool
    faults: FaultInjector


def engine_options(ctx: RunContext, build: RoleBuild) -> EngineOptions:
    """The keyword arguments every backend's engine takes alike from the run and the role's build,
    so a role's engine is configured the same on FSDP and on Megatron."""
    cfg = ctx.cfg
    return EngineOptions(
        precision=cfg.trainer.precision, safety=cfg.safety, gradient_checkpointing=cfg.model.gradient_checkpointing,
        value_head_seed=build.value_head_seed, value_head_bias=build.value_head_bias, faults=ctx.faults,
    )


def role_build(ctx: RunContext, role: str) -> RoleBuild:
    cfg = ctx.cfg
    model_dir = Path(ctx.model_dir_for(role))
    adapters = cfg.model.lora if cfg.model.lora.rank > 0 else None
    if role == "policy" and spec_of(cfg.algo.name).head == "scalar":  # a reward model; with LoRA its head trains in full
        return RoleBuild(model_dir, cfg.optim, int(cfg.trainer.seed), adapters, value_head_bias=False)
    if role == "policy":
        return RoleBuild(model_dir, cfg.optim, None, adapters)
    if role in ("reference", "teacher"):  # frozen, scoring log-probabilities
        return RoleBuild(model_dir, None, None)
    if role == "critic":
        return RoleBuild(model_dir, OmegaConf.merge(cfg.optim, {"lr": float(cfg.critic.lr)}), int(cfg.trainer.seed))
    raise ValueError(f"engine role {role!r} is unknown; choose one of {ROLES}")
