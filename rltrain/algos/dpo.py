"""Direct Preference Optimisation against a frozen reference.

Learns from preference pairs offline, with no rollout engine; the pairs, micro-batches and
held-out accuracy are rltrain/algos/preference.py's, shared with SimPO and ORPO. The loss variants
(`algo.loss`) and the precomputed reference (`algo.precompute_ref_logps`): docs/internals/algos.md.

    python -m rltrain algo=dpo algo.beta=0.1 algo.loss=sigmoid
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from rltrain.algos.preference import (
    PairwisePreference,
    chosen_rejected_lengths,
    chosen_rejected_sums,
    implicit_rewards,
    pair_metrics,
    score_pairs,
)
from rltrain.algos.preference import preference_micro_batches as dpo_micro_batches
from rltrain.backends import build_reference
from rltrain.backends.base import LogProbScorer, PolicyOutput
from rltrain.config.algorithms import AlgoConfig, AlgorithmSpec
from rltrain.config.choices import choice
from rltrain.data.batch import SequenceBatch
from rltrain.data.preference_data import PreferencePair
from rltrain.runtime.errors import UserError

__all__ = [
    "DPO", "DPO_LOSSES", "SPEC", "DPOConfig", "DPOLossType", "attach_reference", "check_dpo", "dpo_micro_batches",
    "dpo_pair_losses", "make_dpo_loss",
]

REF_FILE = "ref_logps.safetensors"


DPOLossType = Literal["sigmoid", "ipo", "hinge", "robust"]
DPO_LOSSES: tuple[str, ...] = get_args(DPOLossType)


@dataclass
class DPOConfig(AlgoConfig):
    name: str = "dpo"
    beta: float = 0.1
    loss: str = choice("sigmoid", DPOLossType)
    label_smoothing: float = 0.0
    sft_weight: float = 0.0
    precompute_ref_logps: bool = False


def check_dpo(algo: DPOConfig) -> None:
    if algo.beta <= 0:
        raise UserError(f"algo.beta={algo.beta} must be positive (the DPO temperature).")
    if not 0 <= algo.label_smoothing < 0.5:
        raise UserError(f"algo.label_smoothing={algo.label_smoothing} must be in [0, 0.5).")


def dpo_pair_losses(
    policy_chosen_P: torch.Tensor,
    policy_rejected_P: torch.Tensor,
    ref_chosen_P: torch.Tensor,
    ref_rejected_P: torch.Tensor,
    beta: float,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lens_P: torch.Tensor | None = None,
    rejected_lens_P: torch.Tensor | None = None,
) -> torch.Tensor:
    """[P] loss of each pair, on per-sequence log-probability sums (docs/internals/algos.md,
    "Preference losses"). `ipo` compares per-token log-ratios (each sum over its completion's
    length, `chosen_lens_P` / `rejected_lens_P`): without it the squared target would grow with the
    completions' length (TRL's form, which the IPO authors confirmed)."""
    h_P = (policy_chosen_P - ref_chosen_P) - (policy_rejected_P - ref_rejected_P)
    eps = label_smoothing
    if loss == "sigmoid":
        return -(1 - eps) * F.logsigmoid(beta * h_P) - eps * F.logsigmoid(-beta * h_P)
    if loss == "robust":
        if not 0 <= eps < 0.5:
            raise ValueError(f"algo.label_smoothing={eps} must be in [0, 0.5) for the robust loss")
        return (-(1 - eps) * F.logsigmoid(beta * h_P) + eps * F.logsigmoid(-beta * h_P)) / (1 - 2 * eps)
    if loss == "hinge":
        return torch.relu(1 - beta * h_P)
    if loss == "ipo":
        if chosen_lens_P is None or rejected_lens_P is None:
            raise ValueError("the ipo loss needs the completion lengths (chosen_lens_P, rejected_lens_P)")
        per_token_h_P = (policy_chosen_P - ref_chosen_P) / chosen_lens_P.clamp(min=1) - (
            policy_rejected_P - ref_rejected_P
        ) / rejected_lens_P.clamp(min=1)
        return (per_token_h_P - 1 / (2 * beta)) ** 2
    raise ValueError(f"algo.loss={loss!r}: choose one of {', '.join(DPO_LOSSES)}")


def make_dpo_loss(beta: float, loss: str, label_smoothing: float, sft_weight: float):
    def dpo_loss(output: PolicyOutput, batch: SequenceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        n_pairs = batch.extras["global_pairs"]
        pol_c, pol_r = chosen_rejected_sums(output.logps)
        # Reference sums are kept on the host (precomputed ones for the whole dataset).
        ref_c, ref_r = batch.extras["ref_chosen"].to(pol_c.device), batch.extras["ref_rejected"].to(pol_c.device)
        len_c, len_r = chosen_rejected_lengths(output.logps) if loss == "ipo" else (None, None)
        losses_P = dpo_pair_losses(pol_c, pol_r, ref_c, ref_r, beta, loss, label_smoothing, len_c, len_r)
        total = losses_P.sum() / n_pairs
        if sft_weight:
            total = total + sft_weight * -pol_c.sum() / batch.extras["global_chosen_tokens"]
        rew_c, rew_r = implicit_rewards(pol_c, ref_c, beta), implicit_rewards(pol_r, ref_r, beta)
        return total, pair_metrics(rew_c, rew_r, pol_c, pol_r, n_pairs)

    return dpo_loss


def attach_reference(micro: list[SequenceBatch], reference) -> None:
    """Online reference: score the same micro-batches with the frozen engine."""
    for mb, scored in zip(micro, reference.forward_logps(micro)):
        mb.extras["ref_chosen"], mb.extras["ref_rejected"] = chosen_rejected_sums(scored.logps)


class DPO(PairwisePreference):
    def __init__(self, ctx) -> None:
        a = ctx.cfg.algo
        self.loss_fn = make_dpo_loss(a.beta, a.loss, a.label_smoothing, a.sft_weight)
        super().__init__(ctx)

    def build_roles(self) -> None:
        cfg = self.ctx.cfg
        self.reference: LogProbScorer | None
        self.reference, _ = build_reference(self.ctx, self.policy, cfg.trainer.max_steps)
        # The reference is frozen, so eval pairs are scored once.
        self.ref_eval = self._reference_sums(self.data.eval)
        self.ref_train: tuple[torch.Tensor, torch.Tensor] | None = None
        if cfg.algo.precompute_ref_logps:
            self.ref_train = self._load_or_compute_train_refs()
            del self.reference
            self.reference = None
            gc.collect()

    # --- reference log-probabilities -----------------------------------------------------------

    def _reference_sums(self, pairs: list[PreferencePair]) -> tuple[torch.Tensor, torch.Tensor]:
        return score_pairs(self.reference, pairs)

    def _load_or_compute_train_refs(self) -> tuple[torch.Tensor, torch.Tensor]:
        path = self.ctx.run_dir / REF_FILE
        if path.exists():
            stored = load_file(str(path))
            if stored["chosen"].numel() == len(self.data.train):
                return stored["chosen"], stored["rejected"]
        chosen, rejected = self._reference_sums(self.data.train)
        if self.ctx.dist.is_main:
            tmp = path.with_suffix(".tmp")
            save_file({"chosen": chosen.contiguous(), "rejected": rejected.contiguous()}, str(tmp))
            os.replace(tmp, path)
        return chosen, rejected

    # --- the step's and evaluation's inputs ----------------------------------------------------

    def attach_inputs(self, micro: list[SequenceBatch], micro_idx: list[list[int]], index: list[int]) -> None:
        if self.ref_train is None:
            attach_reference(micro, self.reference)
            return
        for mb, idx in zip(micro, micro_idx):
            rows = torch.tensor([index[i] for i in idx], dtype=torch.long, device="cpu")
            mb.extras["ref_chosen"], mb.extras["ref_rejected"] = self.ref_train[0][rows], self.ref_train[1][rows]

    def eval_wins(self, policy_chosen_P: torch.Tensor, policy_rejected_P: torch.Tensor) -> torch.Tensor:
        ref_c, ref_r = self.ref_eval
        beta = self.algo_cfg.beta
        return implicit_rewards(policy_chosen_P, ref_c, beta) > implicit_rewards(policy_rejected_P, ref_r, beta)


SPEC = AlgorithmSpec(
    "dpo", DPOConfig, DPO, "direct preference optimisation against a frozen reference",
    data="preferences", reference="always", check=check_dpo,
)
