"""What every RL algorithm (GRPO, PPO, distillation) shares in its config: the experience pipeline's
keys, the policy loss's (surrogate, importance ratio, aggregation, clip, KL) and the rollout
correction's, with `check_rl`, the checks a schema cannot express. Each RL algorithm's own module
extends `RLConfig`; the keys are documented in docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rltrain.config.algorithms import AlgoConfig
from rltrain.config.choices import choice
from rltrain.runtime.errors import UserError

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
# auto: none in sync, tis with placement.max_staleness >= 1 (rltrain/algos/rollout_correction.py: each mode)
RolloutCorrection = Literal["auto", "none", "tis", "mask", "seq_tis", "seq_mask", "geo_mask", "icepop"]
# The keys of rltrain.algos.policy_loss.IMPORTANCE_RATIOS. sequence: GSPO's length-normalised sequence ratio
ImportanceLevel = Literal["token", "sequence"]
# The keys of rltrain.algos.policy_loss.SURROGATES. cispo: the clipped, stop-gradient weight times the log-probability;
# gspo: PPO's clip on GSPO's sequence ratio
PolicyLossKind = Literal["clip", "cispo", "gspo"]


@dataclass
class RLConfig(AlgoConfig):
    """What every RL algorithm shares: the experience pipeline, the policy loss and the rollout
    correction (rltrain/algos/rl/algorithm.py)."""

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
    rollout_is_cap: float = 2.0  # tis, seq_tis: weights truncated at this value; seq_mask: the ratio's upper bound
    rollout_mask_band: float = 2.0  # mask: keep sequences whose train/rollout ratio is in [1/band, band]
    rollout_is_floor: float = 0.0  # seq_mask: the sequence ratio's lower bound
    rollout_geo_band: list[float] = field(default_factory=lambda: [0.999, 1.001])  # geo_mask: [low, high]
    rollout_icepop_band: list[float] = field(default_factory=lambda: [0.5, 5.0])  # icepop: [low, high]
    # A MoE: every trainer forward routes each sampled token to the experts the rollout engine chose
    # for it (rollout=hf records them; backend=fsdp replays them): docs/moe.md, "Router replay".
    router_replay: bool = False


def _at_least(algo: RLConfig, keys: tuple[str, ...], low: int = 1) -> None:
    for key in keys:
        if getattr(algo, key) < low:
            raise UserError(f"algo.{key}={getattr(algo, key)} must be at least {low}.")


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
    for key in ("rollout_geo_band", "rollout_icepop_band"):
        low_high = list(getattr(algo, key))
        if len(low_high) != 2 or not 0 < low_high[0] <= 1 <= low_high[1]:
            raise UserError(
                f"algo.{key}={low_high}: give [low, high] with 0 < low <= 1 <= high, e.g. algo.{key}=[0.5,5.0] "
                "(a ratio of 1, no mismatch, must always be kept)."
            )
    if not 0 <= algo.rollout_is_floor < algo.rollout_is_cap:
        raise UserError(
            f"algo.rollout_is_floor={algo.rollout_is_floor} must be in [0, algo.rollout_is_cap={algo.rollout_is_cap}): "
            "seq_mask keeps a sequence whose importance ratio lies between the two."
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
