"""Direct Preference Optimisation against a frozen reference.

Learns from preference pairs offline, with no rollout engine; the pairs, micro-batches and
held-out accuracy are rltrain/algos/preference.py's, shared with SimPO and ORPO. The loss variants
(`algo.loss`) and the precomputed reference (`algo.precompute_ref_logps`): docs/internals/algos.md.

    python -m rltrain algo=dpo algo.beta=0.1 algo.loss=sigmoid
"""

from __future__ import annotations

import gc
import os

import torch
from safetensors.torch import load_file, save_file

from rltrain.algos.losses import dpo_pair_losses, implicit_rewards
from rltrain.algos.preference import (
    PairwisePreference,
    chosen_rejected_lengths,
    chosen_rejected_sums,
    pair_metrics,
    score_pairs,
)
from rltrain.algos.preference import preference_micro_batches as dpo_micro_batches
from rltrain.backends import build_reference
from rltrain.backends.base import LogProbScorer, PolicyOutput
from rltrain.data.batch import SequenceBatch
from rltrain.data.preference_data import PreferencePair

__all__ = ["DPO", "attach_reference", "dpo_micro_batches", "make_dpo_loss"]

REF_FILE = "ref_logps.safetensors"


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
