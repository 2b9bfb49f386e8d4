"""The preference base DPO, SimPO, ORPO and the reward model share (KTO its implicit reward and
scoring): the pairs of rltrain/data/preference_data.py cut into micro-batches of whole pairs, each
pair's chosen and rejected completions as separate ragged sequences (never padded to each other, so
padding never enters a sum), held-out preference accuracy, and the step itself. An objective
supplies its loss and how a pair's chosen-vs-rejected score is computed; docs/algorithms.md
compares them.
"""

from __future__ import annotations

from typing import Any

import torch

from rltrain.algos.base import PolicyStreamAlgorithm
from rltrain.backends import build_engine
from rltrain.config.run_context import RunContext
from rltrain.data.batch import SequenceBatch
from rltrain.data.preference_data import PreferencePair, build_preference_data
from rltrain.data.sampler import IndexStream
from rltrain.data.sharding import micro_batch_count, rank_slice, split_micro_batches, sum_over_replicas
from rltrain.data.vision_inputs import vision_extras
from rltrain.models.vision import load_processor
from rltrain.run.evaluation import GreedyEvaluator
from rltrain.run.samples import Sample
from rltrain.runtime.precision import resolve_precision


def pairs_to_batch(pairs: list[PreferencePair], **extras: Any) -> SequenceBatch:
    """Sequences 2i and 2i+1 are pair i's chosen and rejected completions."""
    prompts, completions = [], []
    for p in pairs:
        prompts += [p.prompt, p.prompt]
        completions += [p.chosen, p.rejected]
    images = vision_extras([v for p in pairs for v in (p.vision, p.vision)])  # each row carries its images
    return SequenceBatch.from_lists(prompts, completions, **extras, **images)


def chosen_rejected_sums(logps) -> tuple[torch.Tensor, torch.Tensor]:
    """([P], [P]) summed completion log-probabilities of a `pairs_to_batch` batch."""
    sums_S = logps.sum_per_seq()
    return sums_S[0::2], sums_S[1::2]


def chosen_rejected_means(logps) -> tuple[torch.Tensor, torch.Tensor]:
    """([P], [P]) per-token mean completion log-probabilities (each sum over its own length):
    SimPO's and ORPO's length-normalised scores."""
    sums_S = logps.sum_per_seq()
    means_S = sums_S / logps.lengths().to(sums_S.device).clamp(min=1).to(sums_S.dtype)
    return means_S[0::2], means_S[1::2]


def chosen_rejected_lengths(logps) -> tuple[torch.Tensor, torch.Tensor]:
    lengths_S = logps.lengths().to(logps.values.device).to(logps.values.dtype)
    return lengths_S[0::2], lengths_S[1::2]


def implicit_rewards(policy_P: torch.Tensor, ref_P: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO's and KTO's implicit reward of a completion, `beta * (log pi - log ref)` of its sums."""
    return beta * (policy_P - ref_P)


def pair_metrics(
    rewards_chosen_P: torch.Tensor, rewards_rejected_P: torch.Tensor, logps_chosen_P: torch.Tensor,
    logps_rejected_P: torch.Tensor, n_pairs: float,
) -> dict[str, torch.Tensor]:
    """This micro-batch's share of the `dpo/*` metrics every pairwise objective logs, so runs of
    DPO, SimPO and ORPO compare key by key (the rewards are each objective's implicit reward)."""
    rew_c, rew_r = rewards_chosen_P.detach(), rewards_rejected_P.detach()
    return {
        "dpo/rewards_chosen": rew_c.sum() / n_pairs,
        "dpo/rewards_rejected": rew_r.sum() / n_pairs,
        "dpo/margin": (rew_c - rew_r).sum() / n_pairs,
        "dpo/accuracy": (rew_c > rew_r).double().sum() / n_pairs,
        "dpo/logps_chosen": logps_chosen_P.detach().sum() / n_pairs,
        "dpo/logps_rejected": logps_rejected_P.detach().sum() / n_pairs,
    }


def preference_micro_batches(
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


def summed_logps(engine, batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """([P], [P]) a `pairs_to_batch` batch's summed completion log-probabilities under `engine`."""
    (scored,) = engine.forward_logps([batch])
    if len(batch) == 0:
        return scored.logps.values[:0], scored.logps.values[:0]
    return chosen_rejected_sums(scored.logps)


def score_pairs(engine, pairs: list[PreferencePair], chunk: int = 128, score=summed_logps) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pair's chosen and rejected scores (`score(engine, batch)`: summed completion log-probs
    by default), computed in data-parallel slices and shared by one sum all-reduce (model-parallel
    ranks of a replica hold identical copies)."""
    index = list(range(len(pairs)))
    mine = rank_slice(index, engine.rank, engine.world_size)
    count = micro_batch_count(len(pairs), engine.world_size, chunk)
    out = torch.zeros(2, len(pairs), dtype=torch.float64, device="cpu")
    for idx in split_micro_batches(mine, count, chunk):
        c, r = score(engine, pairs_to_batch([pairs[i] for i in idx]))
        if idx:
            out[0, idx], out[1, idx] = c.double().cpu(), r.double().cpu()
    out = sum_over_replicas(out, engine.world_size)
    return out[0].float(), out[1].float()


def completion_lengths(pairs: list[PreferencePair]) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor([len(p.chosen) for p in pairs], dtype=torch.float32, device="cpu"),
        torch.tensor([len(p.rejected) for p in pairs], dtype=torch.float32, device="cpu"),
    )


class AnswerCheck:
    """Greedy completions of the held-out prompts checked against their answers (the built-in
    task's): `eval/accuracy` and the samples for the W&B tables, shared by the preference
    objectives and KTO. `of` gives None where the data has no answers: nothing is generated."""

    def __init__(self, ctx: RunContext, prompts: list[list[int]], answers: list[str]) -> None:
        dtype = resolve_precision(ctx.cfg.trainer.precision, ctx.dist.device).compute_dtype
        self.evaluator = GreedyEvaluator(ctx.model_dir, ctx.tokenizer, dtype, 8, device=ctx.dist.device)
        self.prompts, self.answers = prompts, answers

    @classmethod
    def of(cls, ctx: RunContext, prompts: list[list[int]], answers: list[str]) -> AnswerCheck | None:
        return cls(ctx, prompts, answers) if answers else None

    def accuracy(self, policy) -> tuple[float, list[Sample]]:
        result = self.evaluator.accuracy(policy, self.prompts, self.answers)
        return result.accuracy, result.samples


class PairwisePreference(PolicyStreamAlgorithm):
    """One optimizer step per global batch of preference pairs. Subclasses set `loss_fn` and say
    how a held-out pair is won (`eval_wins`), and may attach per-pair inputs (`attach_inputs`: DPO's
    reference log-probabilities)."""

    loss_fn: Any
    eval_key = "eval/dpo_accuracy"  # held-out preference accuracy, one key for the DPO family
    samples_greedy = True  # greedy completions at evaluation on data with answers (a policy)

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        cfg = ctx.cfg
        self.algo_cfg = cfg.algo
        self.data = build_preference_data(ctx.tokenizer, cfg.data, cfg.trainer.seed, load_processor(ctx.model_dir, ctx.tokenizer))
        self.stream = IndexStream(len(self.data.train), cfg.trainer.seed)
        self.policy = build_engine(ctx, "policy", cfg.trainer.max_steps)
        self.build_roles()
        self.recorded = []
        prompts = [p.prompt for p in self.data.eval]
        self.answer_check = AnswerCheck.of(ctx, prompts, self.data.eval_answers) if self.samples_greedy else None

    def build_roles(self) -> None:
        """Engines besides the policy (DPO's reference), built after it (none by default)."""

    def attach_inputs(self, micro: list[SequenceBatch], micro_idx: list[list[int]], index: list[int]) -> None:
        """Per-pair inputs of the loss beyond the policy's log-probabilities (none by default)."""

    def eval_wins(self, policy_chosen_P: torch.Tensor, policy_rejected_P: torch.Tensor) -> torch.Tensor:
        """[P] bool: the objective's implicit reward prefers the chosen completion (`eval_scores`
        of `self.data.eval` in)."""
        raise NotImplementedError

    def eval_scores(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([P], [P]) the held-out pairs' scores: summed policy log-probabilities by default."""
        return score_pairs(self.policy, self.data.eval)

    def train_step(self, step: int) -> dict[str, float]:
        t = self.ctx.cfg.trainer
        index = self.stream.take(t.global_batch_size)
        pairs = [self.data.train[i] for i in index]
        micro, micro_idx = preference_micro_batches(
            pairs, self.policy.rank, self.policy.world_size, t.micro_batch_size, t.max_tokens_per_micro_batch
        )
        self.attach_inputs(micro, micro_idx, index)
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
            wins = self.eval_wins(*self.eval_scores())
            out[self.eval_key] = float(wins.float().mean())
        if self.answer_check is not None:
            out["eval/accuracy"], self.recorded = self.answer_check.accuracy(self.policy)
        return out
