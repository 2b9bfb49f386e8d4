"""KTO (Ethayarajh et al. 2024): preference optimisation from unpaired examples, each one
completion labelled desirable or not, against a frozen reference.

Each example loses `1 - s(beta (r - z0))` if desirable, `1 - s(beta (z0 - r))` if not (`r`: its
log-ratio to the reference; weights `algo.desirable_weight` / `algo.undesirable_weight`). The
reference point z0 is KTO's KL estimate: each prompt of the step's batch paired with the previous
example's completion, the mean log-ratio of those pairs over every rank, clamped at 0, no gradient.
docs/algorithms.md, "KTO".

    python -m rltrain algo=kto algo.beta=0.1 algo.desirable_weight=1.0 algo.undesirable_weight=1.0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltrain.algos.base import PolicyStreamAlgorithm
from rltrain.algos.preference import AnswerCheck, implicit_rewards, score_pairs
from rltrain.backends import build_engine, build_reference
from rltrain.backends.base import LogProbScorer, PolicyOutput
from rltrain.config.algorithms import AlgoConfig, AlgorithmSpec
from rltrain.config.run_context import RunContext
from rltrain.data.batch import SequenceBatch
from rltrain.data.sampler import IndexStream
from rltrain.data.sharding import micro_batch_count, rank_slice, split_micro_batches, sum_over_replicas
from rltrain.data.unpaired_data import LabelledCompletion, build_unpaired_data
from rltrain.data.vision_inputs import vision_extras
from rltrain.models.vision import load_processor
from rltrain.runtime.errors import UserError


@dataclass
class KTOConfig(AlgoConfig):
    """KTO on unpaired examples (prompt, completion, boolean label)."""

    name: str = "kto"
    beta: float = 0.1
    desirable_weight: float = 1.0  # weight of a desirable (label true) example's loss
    undesirable_weight: float = 1.0  # weight of an undesirable (label false) example's loss


def check_kto(algo: KTOConfig) -> None:
    if algo.beta <= 0:
        raise UserError(f"algo.beta={algo.beta} must be positive (KTO's temperature on the log-ratio to the reference).")
    if algo.desirable_weight < 0 or algo.undesirable_weight < 0 or algo.desirable_weight + algo.undesirable_weight == 0:
        raise UserError(
            f"algo.desirable_weight={algo.desirable_weight} and algo.undesirable_weight={algo.undesirable_weight} must "
            "be at least 0 and not both 0 (they weight the losses of examples labelled true and false)."
        )


def kto_reference_kl(policy_mismatched_B: torch.Tensor, ref_mismatched_B: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z0 (Ethayarajh et al. 2024, eq. 7 and section 4.1): the batch's mean of
    `log pi(y'|x) - log ref(y'|x)` over mismatched pairs (each prompt with another example's
    completion), clamped at 0 and detached: a biased but cheap estimate of KL(pi || ref), no
    gradient flows through it."""
    return (policy_mismatched_B.float() - ref_mismatched_B.float()).mean().clamp(min=0).detach()


def kto_losses(
    policy_B: torch.Tensor,
    ref_B: torch.Tensor,
    desirable_B: torch.Tensor,
    kl: torch.Tensor | float,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """[B] KTO's loss of each unpaired example (eq. 7 with the constant lambda_y dropped, as TRL
    does): with `r = log pi - log ref` of its completion, a desirable one (`desirable_B` True) loses
    `desirable_weight * (1 - s(beta (r - z0)))`, an undesirable one
    `undesirable_weight * (1 - s(beta (z0 - r)))`; `kl` is z0 (`kto_reference_kl`)."""
    logratio_B = policy_B.float() - ref_B.float()
    desirable_B = desirable_B.to(device=logratio_B.device, dtype=torch.bool)
    kl_t = torch.as_tensor(kl, dtype=logratio_B.dtype, device=logratio_B.device).detach()
    desirable_loss_B = desirable_weight * (1 - torch.sigmoid(beta * (logratio_B - kl_t)))
    undesirable_loss_B = undesirable_weight * (1 - torch.sigmoid(beta * (kl_t - logratio_B)))
    return torch.where(desirable_B, desirable_loss_B, undesirable_loss_B)


def examples_to_batch(examples: list[LabelledCompletion], **extras) -> SequenceBatch:
    images = vision_extras([e.vision for e in examples])  # each example carries its prompt's images
    batch = SequenceBatch.from_lists([e.prompt for e in examples], [e.completion for e in examples], **extras, **images)
    batch.extras["desirable"] = torch.tensor([e.desirable for e in examples], dtype=torch.bool, device="cpu")
    return batch


def mismatched(examples: list[LabelledCompletion], max_length: int) -> list[LabelledCompletion]:
    """KTO's mismatched pairs: example i's prompt (with its images) with example i-1's completion
    (the first with the last's), cut to `data.max_length` tokens."""
    out = []
    for i, ex in enumerate(examples):
        room = max(1, max_length - len(ex.prompt))
        out.append(LabelledCompletion(ex.prompt, examples[i - 1].completion[:room], ex.desirable, ex.vision))
    return out


def score_sequences(engine: LogProbScorer, examples: list[LabelledCompletion], chunk: int = 128) -> torch.Tensor:
    """[B] every example's summed completion log-probability under `engine`, no gradients, scored in
    data-parallel slices and shared by one sum all-reduce (every rank calls it together)."""
    mine = rank_slice(list(range(len(examples))), engine.rank, engine.world_size)
    count = micro_batch_count(len(examples), engine.world_size, chunk)
    out = torch.zeros(len(examples), dtype=torch.float64, device="cpu")
    for idx in split_micro_batches(mine, count, chunk):
        (scored,) = engine.forward_logps([examples_to_batch([examples[i] for i in idx])])
        if idx:
            out[idx] = scored.policy_logps().sum_per_seq().double().cpu()
    return sum_over_replicas(out, engine.world_size).float()


def kto_micro_batches(
    examples: list[LabelledCompletion], rank: int, world_size: int, micro_batch_size: int, max_tokens: int, kl: float
) -> list[SequenceBatch]:
    """This rank's micro-batches of the step's examples, carrying the global counts every term is
    divided by and the step's reference point `kl`."""
    desirable = float(sum(e.desirable for e in examples))
    extras = {
        "global_examples": float(len(examples)), "global_desirable": desirable,
        "global_undesirable": float(len(examples)) - desirable, "kl": kl,
    }
    mine = rank_slice(list(range(len(examples))), rank, world_size)
    count = micro_batch_count(len(examples), world_size, micro_batch_size)
    sizes = [len(examples[i].prompt) + len(examples[i].completion) for i in mine]
    micro_idx = split_micro_batches(mine, count, micro_batch_size, sizes, max_tokens)
    return [examples_to_batch([examples[i] for i in idx], **extras) for idx in micro_idx]


def make_kto_loss(beta: float, desirable_weight: float, undesirable_weight: float):
    def kto_loss(output: PolicyOutput, batch: SequenceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        pol_B = output.policy_logps().sum_per_seq()
        ref_B = batch.extras["ref_logps"].to(pol_B.device)
        desirable_B = batch.extras["desirable"].to(pol_B.device)
        losses_B = kto_losses(pol_B, ref_B, desirable_B, batch.extras["kl"], beta, desirable_weight, undesirable_weight)
        rewards_B = implicit_rewards(pol_B.detach().float(), ref_B.float(), beta)
        n_good, n_bad = max(batch.extras["global_desirable"], 1.0), max(batch.extras["global_undesirable"], 1.0)
        good_B, bad_B = desirable_B.float(), (~desirable_B).float()
        metrics = {
            "kto/rewards_chosen": (rewards_B * good_B).sum() / n_good,
            "kto/rewards_rejected": (rewards_B * bad_B).sum() / n_bad,
            "kto/logps_chosen": (pol_B.detach().float() * good_B).sum() / n_good,
            "kto/logps_rejected": (pol_B.detach().float() * bad_B).sum() / n_bad,
        }
        return losses_B.sum() / batch.extras["global_examples"], metrics

    return kto_loss


class KTO(PolicyStreamAlgorithm):
    eval_key = "eval/dpo_accuracy"  # held-out preference accuracy, the DPO family's key

    def __init__(self, ctx: RunContext) -> None:
        cfg = ctx.cfg
        if cfg.trainer.global_batch_size < 2:
            raise UserError(
                f"algo=kto with trainer.global_batch_size={cfg.trainer.global_batch_size}: KTO's reference point pairs "
                "each prompt with another example's completion in the step's batch, so a batch needs at least 2 "
                "examples. Raise trainer.global_batch_size."
            )
        self.ctx, self.algo_cfg = ctx, cfg.algo
        a = cfg.algo
        self.loss_fn = make_kto_loss(a.beta, a.desirable_weight, a.undesirable_weight)
        self.data = build_unpaired_data(ctx.tokenizer, cfg.data, cfg.trainer.seed, load_processor(ctx.model_dir, ctx.tokenizer))
        self.stream = IndexStream(len(self.data.train), cfg.trainer.seed)
        self.policy = build_engine(ctx, "policy", cfg.trainer.max_steps)
        self.reference: LogProbScorer
        self.reference, _ = build_reference(ctx, self.policy, cfg.trainer.max_steps)
        self.ref_eval = score_pairs(self.reference, self.data.eval)  # frozen: the held-out pairs scored once
        self.recorded = []
        self.answer_check = AnswerCheck.of(ctx, [e.prompt for e in self.data.eval], self.data.eval_answers)

    def reference_point(self, examples: list[LabelledCompletion]) -> torch.Tensor:
        """z0 of this step: `kto_reference_kl` of the batch's mismatched pairs, policy and reference."""
        pairs = mismatched(examples, self.ctx.cfg.data.max_length)
        return kto_reference_kl(score_sequences(self.policy, pairs), score_sequences(self.reference, pairs))

    def train_step(self, step: int) -> dict[str, float]:
        t = self.ctx.cfg.trainer
        examples = [self.data.train[i] for i in self.stream.take(t.global_batch_size)]
        kl = self.reference_point(examples)
        micro = kto_micro_batches(
            examples, self.policy.rank, self.policy.world_size, t.micro_batch_size, t.max_tokens_per_micro_batch, float(kl)
        )
        for mb, scored in zip(micro, self.reference.forward_logps(micro)):
            mb.extras["ref_logps"] = scored.policy_logps().sum_per_seq().detach()
        metrics = self.policy.train_step(micro, self.loss_fn)
        metrics["kto/kl"] = float(kl)
        metrics["tokens"] = float(sum(len(e.prompt) + len(e.completion) for e in examples))
        metrics["examples"] = float(len(examples))
        metrics["data/skipped_empty"] = float(self.data.skipped.empty)
        metrics["data/overlong_dropped"] = float(self.data.skipped.overlong.dropped)
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.data.eval:
            (pol_c, pol_r), (ref_c, ref_r), beta = score_pairs(self.policy, self.data.eval), self.ref_eval, self.algo_cfg.beta
            wins = implicit_rewards(pol_c, ref_c, beta) > implicit_rewards(pol_r, ref_r, beta)
            out[self.eval_key] = float(wins.float().mean())
        if self.answer_check is not None:
            out["eval/accuracy"], self.recorded = self.answer_check.accuracy(self.policy)
        return out


SPEC = AlgorithmSpec(
    "kto", KTOConfig, KTO, "KTO: unpaired desirable/undesirable completions against a frozen reference",
    data="unpaired", reference="always", check=check_kto,
)
