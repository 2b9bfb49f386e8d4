"""Every algorithm, declared once: its config class (the `algo` group option's schema) and an
`AlgorithmSpec` saying what it needs (generation, rewards, a reference, a critic, a teacher, which
data). Validation, the `algo` group's registration and the trainer's wiring all read `ALGORITHMS`,
so adding an algorithm is one config class, one spec, its YAML defaults and its implementation:
docs/adding-an-algorithm.md walks it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

from omegaconf import MISSING

from rltrain.config.choices import choice
from rltrain.runtime.errors import UserError

DPOLossType = Literal["sigmoid", "ipo", "hinge", "robust"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
RolloutCorrection = Literal["auto", "none", "tis", "mask"]  # auto: none in sync, tis with placement.max_staleness >= 1
ScaleRewards = Literal["group", "batch", "none"]
ImportanceLevel = Literal["token", "sequence"]  # sequence: GSPO's length-normalised sequence ratio
PolicyLossKind = Literal["clip", "cispo"]  # cispo: the clipped, stop-gradient weight times the log-probability
# rltrain/data: sft_data, preference_data (pairs), unpaired_data (labelled completions), prompt_data
DataKind = Literal["completions", "preferences", "unpaired", "prompts"]
ReferenceNeed = Literal["never", "always", "when_beta"]  # when_beta: only with algo.beta > 0
OutputHead = Literal["lm", "scalar"]  # scalar: the trained model ends in a one-output head (a reward model)


# --- config classes (each `conf/algo/<name>.yaml` extends `algo/<name>_schema`) -----------------


@dataclass
class AlgoConfig:
    name: str = MISSING


@dataclass
class SFTConfig(AlgoConfig):
    name: str = "sft"


@dataclass
class DPOConfig(AlgoConfig):
    name: str = "dpo"
    beta: float = 0.1
    loss: str = choice("sigmoid", DPOLossType)
    label_smoothing: float = 0.0
    sft_weight: float = 0.0
    precompute_ref_logps: bool = False


@dataclass
class SimPOConfig(AlgoConfig):
    name: str = "simpo"
    beta: float = 2.0  # temperature on the per-token mean log-probabilities
    gamma: float = 1.0  # target reward margin between chosen and rejected


@dataclass
class ORPOConfig(AlgoConfig):
    name: str = "orpo"
    lambda_: float = 0.1  # weight of the odds-ratio term next to the chosen completions' NLL


@dataclass
class RewardModelConfig(AlgoConfig):
    """Bradley-Terry reward-model training on preference pairs (rltrain/algos/rm.py)."""

    name: str = "rm"
    # TRL's center_rewards_coefficient: this times the mean of (r_chosen + r_rejected)^2 keeps the
    # scores near zero (the pair loss sees only their difference); 0 turns it off.
    center_rewards_coefficient: float = 0.0


@dataclass
class KTOConfig(AlgoConfig):
    """KTO on unpaired examples (prompt, completion, boolean label): rltrain/algos/kto.py."""

    name: str = "kto"
    beta: float = 0.1
    desirable_weight: float = 1.0  # weight of a desirable (label true) example's loss
    undesirable_weight: float = 1.0  # weight of an undesirable (label false) example's loss


@dataclass
class RLConfig(AlgoConfig):
    """What every RL algorithm shares: the experience pipeline, the policy loss and the rollout
    correction (rltrain/algos/rl.py)."""

    group_size: int = 8
    prompts_per_step: int = 16
    mini_batches: int = 1
    num_iterations: int = 1
    loss_agg: str = choice("token_mean", LossAgg)
    importance_level: str = choice("token", ImportanceLevel)
    policy_loss: str = choice("clip", PolicyLossKind)
    clip_low: float = 0.2
    clip_high: float = 0.28
    beta: float = 0.0  # KL to the reference (0: no reference model)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 6
    # DAPO's soft overlong punishment: a completion longer than max_new_tokens - overlong_buffer
    # loses up to overlong_penalty, linearly over the buffer (0 = off).
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    # DAPO's dynamic sampling: groups whose rewards are all equal are dropped and new prompts sampled,
    # at most max_sampling_rounds rounds of prompts_per_step prompts per step (docs/algorithms.md).
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    rollout_correction: str = choice("auto", RolloutCorrection)
    rollout_is_cap: float = 2.0  # tis: token importance weights truncated at this value
    rollout_mask_band: float = 2.0  # mask: keep sequences whose train/rollout ratio is in [1/band, band]


@dataclass
class GRPOConfig(RLConfig):
    name: str = "grpo"
    scale_rewards: str = choice("group", ScaleRewards)


@dataclass
class PPOConfig(RLConfig):
    name: str = "ppo"
    gamma: float = 1.0  # GAE discount
    lam: float = 0.95  # GAE lambda
    vf_clip: float = 0.2  # clipped value loss: values move at most this far from the old ones
    critic_warmup_steps: int = 0  # the first steps train the critic only
    whiten_advantages: bool = True
    kl_in_reward: bool = False  # true: -beta * KL per token in the reward; false: beta * k3 in the loss


@dataclass
class DistillConfig(RLConfig):
    """On-policy distillation: RL's sampling and policy loss with the per-token reverse KL to the
    teacher as the (negated) advantage; no rewards, no reference (`beta` stays 0)."""

    name: str = "distill"


# --- value checks a schema cannot express (run by rltrain.preflight.validate) ---------------------


def _at_least(algo: RLConfig, keys: tuple[str, ...], low: int = 1) -> None:
    for key in keys:
        if getattr(algo, key) < low:
            raise UserError(f"algo.{key}={getattr(algo, key)} must be at least {low}.")


def check_dpo(algo: DPOConfig) -> None:
    if algo.beta <= 0:
        raise UserError(f"algo.beta={algo.beta} must be positive (the DPO temperature).")
    if not 0 <= algo.label_smoothing < 0.5:
        raise UserError(f"algo.label_smoothing={algo.label_smoothing} must be in [0, 0.5).")


def check_simpo(algo: SimPOConfig) -> None:
    if algo.beta <= 0 or algo.gamma < 0:
        raise UserError(
            f"algo.beta={algo.beta} must be positive and algo.gamma={algo.gamma} at least 0 (SimPO's temperature "
            "and target margin)."
        )


def check_orpo(algo: ORPOConfig) -> None:
    if algo.lambda_ < 0:
        raise UserError(f"algo.lambda_={algo.lambda_} must be at least 0 (the odds-ratio term's weight; 0 is plain SFT).")


def check_rm(algo: RewardModelConfig) -> None:
    if algo.center_rewards_coefficient < 0:
        raise UserError(
            f"algo.center_rewards_coefficient={algo.center_rewards_coefficient} must be at least 0 (0: no centering)."
        )


def check_kto(algo: KTOConfig) -> None:
    if algo.beta <= 0:
        raise UserError(f"algo.beta={algo.beta} must be positive (KTO's temperature on the log-ratio to the reference).")
    if algo.desirable_weight < 0 or algo.undesirable_weight < 0 or algo.desirable_weight + algo.undesirable_weight == 0:
        raise UserError(
            f"algo.desirable_weight={algo.desirable_weight} and algo.undesirable_weight={algo.undesirable_weight} must "
            "be at least 0 and not both 0 (they weight the losses of examples labelled true and false)."
        )


def check_rl(algo: RLConfig) -> None:
    _at_least(
        algo, ("group_size", "prompts_per_step", "mini_batches", "num_iterations", "max_new_tokens", "max_sampling_rounds")
    )
    if algo.temperature <= 0 or not 0 < algo.top_p <= 1:
        raise UserError(f"algo.temperature={algo.temperature} must be positive and algo.top_p={algo.top_p} in (0, 1].")
    if algo.clip_low < 0 or algo.clip_high < 0 or algo.beta < 0:
        raise UserError(
            f"algo.clip_low={algo.clip_low}, algo.clip_high={algo.clip_high} and algo.beta={algo.beta} must be at least 0."
        )
    if algo.rollout_is_cap <= 0 or algo.rollout_mask_band < 1:
        raise UserError(
            f"algo.rollout_is_cap={algo.rollout_is_cap} must be positive and algo.rollout_mask_band="
            f"{algo.rollout_mask_band} at least 1 (sequences are kept when their ratio is in [1/band, band])."
        )
    if algo.dynamic_sampling and algo.group_size < 2:
        raise UserError(
            f"algo.dynamic_sampling=true with algo.group_size={algo.group_size}: a group of one completion never has "
            "rewards that differ, so every group would be dropped. Use algo.group_size >= 2."
        )
    if not 0 <= algo.overlong_buffer < algo.max_new_tokens or algo.overlong_penalty < 0:
        raise UserError(
            f"algo.overlong_buffer={algo.overlong_buffer} must be in [0, algo.max_new_tokens={algo.max_new_tokens}) and "
            f"algo.overlong_penalty={algo.overlong_penalty} at least 0: the penalty grows from 0 to overlong_penalty over "
            "the last overlong_buffer tokens of the generation budget (0 turns it off)."
        )


def check_ppo(algo: PPOConfig) -> None:
    check_rl(algo)
    if not (0 <= algo.gamma <= 1 and 0 <= algo.lam <= 1):
        raise UserError(f"algo.gamma={algo.gamma} and algo.lam={algo.lam} must be in [0, 1] (GAE).")
    if algo.vf_clip <= 0 or algo.critic_warmup_steps < 0:
        raise UserError(
            f"algo.vf_clip={algo.vf_clip} must be positive and algo.critic_warmup_steps={algo.critic_warmup_steps} at least 0."
        )


def check_distill(algo: DistillConfig) -> None:
    check_rl(algo)
    if algo.beta != 0:
        raise UserError(
            f"algo.beta={algo.beta}: algo=distill builds no reference; its objective is already a KL, to the teacher. "
            "Leave algo.beta=0."
        )
    if algo.dynamic_sampling or algo.overlong_buffer:
        raise UserError(
            f"algo.dynamic_sampling={algo.dynamic_sampling} / algo.overlong_buffer={algo.overlong_buffer} with algo=distill: "
            "both act on rewards, and distillation trains on the teacher's log-probabilities alone. Set "
            "algo.dynamic_sampling=false and algo.overlong_buffer=0."
        )


def _no_checks(algo: AlgoConfig) -> None:
    """An algorithm whose keys the schema's types already bound."""


# --- the declarations ----------------------------------------------------------------------------


@dataclass(frozen=True)
class AlgorithmSpec:
    """What an algorithm is and needs. `generates`: it samples from the policy with a rollout engine
    each step (so `rollout`, `placement.max_staleness`, `env` apply); `rewards`: its samples are
    scored (`reward.fns`, `reward_model`, environments); `reference`: when a frozen reference is
    built; `critic`: PPO's value model; `teacher`: a model scoring the policy's samples; `head`: the
    trained model's output, the LM head or a scalar head (a reward model, saved as a Hugging Face
    sequence classifier)."""

    name: str
    config: type[AlgoConfig]
    impl: str  # "module:Class", imported by the trainer only when the algorithm runs
    summary: str  # one line, for --help and the docs
    data: DataKind
    generates: bool = False
    rewards: bool = False
    reference: ReferenceNeed = "never"
    critic: bool = False
    teacher: bool = False
    head: OutputHead = "lm"
    check: Callable[[Any], None] = _no_checks

    def builds_reference(self, algo: AlgoConfig) -> bool:
        """Whether a run of this algorithm with settings `algo` builds a reference model."""
        return self.reference == "always" or (self.reference == "when_beta" and cast(RLConfig, algo).beta != 0)


SPECS: tuple[AlgorithmSpec, ...] = (
    AlgorithmSpec(
        "sft", SFTConfig, "rltrain.algos.sft:SFT", "supervised fine-tuning on prompt/completion pairs",
        data="completions",
    ),
    AlgorithmSpec(
        "dpo", DPOConfig, "rltrain.algos.dpo:DPO", "direct preference optimisation against a frozen reference",
        data="preferences", reference="always", check=check_dpo,
    ),
    AlgorithmSpec(
        "simpo", SimPOConfig, "rltrain.algos.simpo:SimPO", "SimPO: length-normalised preference margin, no reference",
        data="preferences", reference="never", check=check_simpo,
    ),
    AlgorithmSpec(
        "orpo", ORPOConfig, "rltrain.algos.orpo:ORPO", "ORPO: SFT plus an odds-ratio preference term, no reference",
        data="preferences", reference="never", check=check_orpo,
    ),
    AlgorithmSpec(
        "kto", KTOConfig, "rltrain.algos.kto:KTO", "KTO: unpaired desirable/undesirable completions against a frozen reference",
        data="unpaired", reference="always", check=check_kto,
    ),
    AlgorithmSpec(
        "rm", RewardModelConfig, "rltrain.algos.rm:RewardModel", "Bradley-Terry reward model on preference pairs (a sequence classifier)",
        data="preferences", reference="never", head="scalar", check=check_rm,
    ),
    AlgorithmSpec(
        "grpo", GRPOConfig, "rltrain.algos.grpo:GRPO", "group-relative policy optimisation (also GSPO, CISPO, Dr. GRPO, DAPO)",
        data="prompts", generates=True, rewards=True, reference="when_beta", check=check_rl,
    ),
    AlgorithmSpec(
        "distill", DistillConfig, "rltrain.algos.distill:Distill", "on-policy distillation: reverse KL to a teacher on the policy's samples",
        data="prompts", generates=True, teacher=True, check=check_distill,
    ),
    AlgorithmSpec(
        "ppo", PPOConfig, "rltrain.algos.ppo:PPO", "PPO with a critic (GAE, clipped value loss)",
        data="prompts", generates=True, rewards=True, reference="when_beta", critic=True, check=check_ppo,
    ),
)
ALGORITHMS: dict[str, AlgorithmSpec] = {spec.name: spec for spec in SPECS}


def spec_of(name: str) -> AlgorithmSpec:
    return ALGORITHMS[name]


def names_where(predicate: Callable[[AlgorithmSpec], bool]) -> list[str]:
    """The algorithms whose spec satisfies `predicate`, for messages ("GRPO and PPO do")."""
    return [spec.name for spec in SPECS if predicate(spec)]
