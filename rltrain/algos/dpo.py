"""Direct Preference Optimisation against a frozen reference.

Learns from preference pairs offline, with no rollout engine; chosen and rejected completions are
separate ragged sequences, so padding never enters a log-probability sum. The loss variants and
the precomputed reference (`algo.precompute_ref_logps`): docs/internals/algos.md.

    python -m rltrain algo=dpo algo.beta=0.1 algo.loss_type=sigmoid
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rltrain.algos.base import PolicyStreamAlgorithm
from rltrain.algos.losses import dpo_pair_losses, implicit_rewards
from rltrain.backends import build_engine, build_reference
from rltrain.backends.base import LogProbScorer, PolicyOutput
from rltrain.config.run_context import RunContext
from rltrain.data.batch import SequenceBatch
from rltrain.data.preference_data import PreferencePair, build_preference_data
from rltrain.data.sampler import IndexStream
from rltrain.data.sharding import micro_batch_count, rank_slice, split_micro_batches, sum_over_replicas
from rltrain.run.evaluation import GreedyEvaluator
from rltrain.runtime.precision import resolve_precision

REF_FILE = "ref_logps.safetensors"


def pairs_to_batch(pairs: list[PreferencePair], **extras: Any) -> SequenceBatch:
    """Sequences 2i and 2i+1 are pair i's chosen and rejected completions."""
    prompts, completions = [], []
    for p in pairs:
        prompts += [p.prompt, p.prompt]
        completions += [p.chosen, p.rejected]
    return SequenceBatch.from_lists(prompts, completions, **extras)


def chosen_rejected_sums(logps) -> tuple[torch.Tensor, torch.Tensor]:
    sums_S = logps.sum_per_seq()
    return sums_S[0::2], sums_S[1::2]


def make_dpo_loss(beta: float, loss_type: str, label_smoothing: float, sft_weight: float):
    def dpo_loss(output: PolicyOutput, batch: SequenceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        n_pairs = batch.extras["global_pairs"]
        pol_c, pol_r = chosen_rejected_sums(output.logps)
        # Reference sums are kept on the host (precomputed ones for the whole dataset).
        ref_c, ref_r = batch.extras["ref_chosen"].to(pol_c.device), batch.extras["ref_rejected"].to(pol_c.device)
        loss = dpo_pair_losses(pol_c, pol_r, ref_c, ref_r, beta, loss_type, label_smoothing).sum() / n_pairs
        if sft_weight:
            loss = loss + sft_weight * -pol_c.sum() / batch.extras["global_chosen_tokens"]
        rew_c, rew_r = implicit_rewards(pol_c, ref_c, beta).detach(), implicit_rewards(pol_r, ref_r, beta).detach()
        metrics = {
            "dpo/rewards_chosen": rew_c.sum() / n_pairs,
            "dpo/rewards_rejected": rew_r.sum() / n_pairs,
            "dpo/margin": (rew_c - rew_r).sum() / n_pairs,
            "dpo/accuracy": (rew_c > rew_r).double().sum() / n_pairs,
            "dpo/logps_chosen": pol_c.detach().sum() / n_pairs,
            "dpo/logps_rejected": pol_r.detach().sum() / n_pairs,
        }
        return loss, metrics

    return dpo_loss


def dpo_micro_batches(
    pairs: list[PreferencePair], rank: int, world_size: int, micro_batch_size: int, max_tokens: int = 0
) -> tuple[list[SequenceBatch], list[list[int]]]:
    """This rank's micro-batches of whole pairs (+ the pair positions in each), carrying the global
    pair and chosen-token counts every loss term is divided by."""
    extras = {
        "global_pairs": float(len(pairs)),
        "global_chosen_tokens": float(sum(len(p.chosen) for p in pairs)),
    }
    mine = rank_slice(list(range(len(pairs))), rank, world_size)
    count = micro_batch_count(len(pairs), world_size, micro_batch_size)
    # A pair's prompt is computed once for both completions (shared-prefix packing).
    sizes = [len(pairs[i].prompt) + len(pairs[i].chosen) + len(pairs[i].rejected) for i in mine]
    micro_idx = split_micro_batches(mine, count, micro_batch_size, sizes, max_tokens)
    return [pairs_to_batch([pairs[i] for i in idx], **extras) for idx in micro_idx], micro_idx


def attach_reference(micro: list[SequenceBatch], reference) -> None:
    """Online reference: score the same micro-batches with the frozen engine."""
    for mb, scored in zip(micro, reference.forward_logps(micro)):
        mb.extras["ref_chosen"], mb.extras["ref_rejected"] = chosen_rejected_sums(scored.logps)


class DPO(PolicyStreamAlgorithm):
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        cfg = ctx.cfg
        self.algo_cfg = cfg.algo
        self.data = build_preference_data(ctx.tokenizer, cfg.data, cfg.trainer.seed)
        self.stream = IndexStream(len(self.data.train), cfg.trainer.seed)
        self.loss_fn = make_dpo_loss(
            cfg.algo.beta, cfg.algo.loss_type, cfg.algo.label_smoothing, cfg.algo.sft_weight
        )
        self.policy = build_engine(ctx, "policy", cfg.trainer.max_steps)
        self.reference: LogProbScorer | None
        self.reference, _ = build_reference(ctx, self.policy, cfg.trainer.max_steps)
        # The reference is frozen, so eval pairs are scored once.
        self.ref_eval = self._reference_sums(self.data.eval)
        self.ref_train: tuple[torch.Tensor, torch.Tensor] | None = None
        if cfg.algo.precompute_ref_logps:
            self.ref_train = self._load_or_compute_train_refs()
            del self.reference
            self.reference = None
            gc.collect()
        # Samples: greedy completions at evaluation when the data has answers to check them
        # against (the built-in task does); without answers DPO generates nothing and records none.
        self.recorded = []
        self.evaluator = None
        if self.data.eval_answers:
            self.evaluator = GreedyEvaluator(ctx.model_dir, ctx.tokenizer, resolve_precision(cfg.trainer.precision, ctx.dist.device).compute_dtype, 8, device=ctx.dist.device)

    # --- reference log-probabilities -----------------------------------------------------------

    def _score_pairs(self, engine, pairs: list[PreferencePair], chunk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed completion log-probs of every pair, computed in data-parallel slices and shared by
        one sum all-reduce (model-parallel ranks of a replica hold identical copies)."""
        index = list(range(len(pairs)))
        mine = rank_slice(index, engine.rank, engine.world_size)
        count = micro_batch_count(len(pairs), engine.world_size, chunk)
        out = torch.zeros(2, len(pairs), dtype=torch.float64, device="cpu")
        for idx in split_micro_batches(mine, count, chunk):
            (scored,) = engine.forward_logps([pairs_to_batch([pairs[i] for i in idx])])
            if idx:
                c, r = chosen_rejected_sums(scored.logps)
                out[0, idx], out[1, idx] = c.double().cpu(), r.double().cpu()
        out = sum_over_replicas(out, engine.world_size)
        return out[0].float(), out[1].float()

    def _reference_sums(self, pairs: list[PreferencePair]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._score_pairs(self.reference, pairs)

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

    # --- training ------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, float]:
        t = self.ctx.cfg.trainer
        index = self.stream.take(t.global_batch_size)
        pairs = [self.data.train[i] for i in index]
        micro, micro_idx = dpo_micro_batches(
            pairs, self.policy.rank, self.policy.world_size, t.micro_batch_size, t.max_tokens_per_micro_batch
        )
        if self.ref_train is not None:
            for mb, idx in zip(micro, micro_idx):
                rows = torch.tensor([index[i] for i in idx], dtype=torch.long, device="cpu")
                mb.extras["ref_chosen"], mb.extras["ref_rejected"] = self.ref_train[0][rows], self.ref_train[1][rows]
        else:
            attach_reference(micro, self.reference)
        metrics = self.policy.train_step(micro, self.loss_fn)
        metrics["tokens"] = float(sum(2 * len(p.prompt) + len(p.chosen) + len(p.rejected) for p in pairs))
        metrics["pairs"] = float(len(pairs))
        metrics["data/skipped_identical"] = float(self.data.skipped.identical)
        metrics["data/skipped_empty"] = float(self.data.skipped.empty)
        metrics["data/overlong_dropped"] = float(self.data.skipped.overlong.dropped)
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.data.eval:
            pol_c, pol_r = self._score_pairs(self.policy, self.data.eval)
            ref_c, ref_r = self.ref_eval
            beta = self.algo_cfg.beta
            wins = implicit_rewards(pol_c, ref_c, beta) > implicit_rewards(pol_r, ref_r, beta)
            out["eval/dpo_accuracy"] = float(wins.float().mean())
        if self.evaluator is not None:
            prompts = [p.prompt for p in self.data.eval]
            result = self.evaluator.accuracy(self.policy, prompts, self.data.eval_answers)
            out["eval/accuracy"], self.recorded = result.accuracy, result.samples
        return out
