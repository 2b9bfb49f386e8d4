"""Supervised fine-tuning.

What it does: next-token negative log-likelihood of the *completion* tokens only (prompt tokens
are context and carry no loss, as in TRL's completion-only training); the completion ends with
EOS so the model learns to stop. The loss of a step is the sum over every completion token of the
global batch divided by the number of those tokens, so micro-batch size, accumulation and the
number of ranks do not change it. No packing across examples, no label smoothing.

    python -m rltrain algo=sft
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltrain.algos.base import PolicyStreamAlgorithm
from rltrain.backends import build_engine
from rltrain.backends.base import PolicyOutput
from rltrain.config.algorithms import AlgoConfig, AlgorithmSpec
from rltrain.config.run_context import RunContext
from rltrain.data.batch import SequenceBatch
from rltrain.data.sampler import IndexStream
from rltrain.data.sft_data import build_sft_data
from rltrain.data.sharding import micro_batch_count, rank_slice, split_micro_batches
from rltrain.data.vision_inputs import vision_extras
from rltrain.models.vision import load_processor
from rltrain.run.evaluation import GreedyEvaluator
from rltrain.runtime.precision import resolve_precision


@dataclass
class SFTConfig(AlgoConfig):
    name: str = "sft"


def sft_loss(output: PolicyOutput, batch: SequenceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed completion NLL over the global completion-token count (in `extras`)."""
    global_tokens = batch.extras["global_tokens"]
    loss = -output.policy_logps().values.sum() / global_tokens
    return loss, {}


class SFT(PolicyStreamAlgorithm):
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        cfg = ctx.cfg
        self.data = build_sft_data(ctx.tokenizer, cfg.data, cfg.trainer.seed, load_processor(ctx.model_dir, ctx.tokenizer))
        self.stream = IndexStream(len(self.data.train), cfg.trainer.seed)
        self.policy = build_engine(ctx, "policy", cfg.trainer.max_steps)
        max_answer = max((len(ctx.tokenizer(e.reference)["input_ids"]) for e in self.data.eval), default=8)
        self.recorded = []
        self.evaluator = GreedyEvaluator(ctx.model_dir, ctx.tokenizer, resolve_precision(cfg.trainer.precision, ctx.dist.device).compute_dtype, max_answer + 2, device=ctx.dist.device)

    def _global_batch(self) -> list[int]:
        return self.stream.take(self.ctx.cfg.trainer.global_batch_size)

    def train_step(self, step: int) -> dict[str, float]:
        t = self.ctx.cfg.trainer
        pairs = [self.data.train[i] for i in self._global_batch()]
        global_completion = sum(len(p.completion) for p in pairs)
        # Data-parallel rank and size come from the engine: model-parallel ranks share data.
        dp_rank, dp_size = self.policy.rank, self.policy.world_size
        mine = rank_slice(pairs, dp_rank, dp_size)
        count = micro_batch_count(len(pairs), dp_size, t.micro_batch_size)
        micro = [
            SequenceBatch.from_lists(
                [p.prompt for p in mb], [p.completion for p in mb], global_tokens=global_completion,
                **vision_extras([p.vision for p in mb]),
            )
            for mb in split_micro_batches(
                mine, count, t.micro_batch_size, [len(p.prompt) + len(p.completion) for p in mine], t.max_tokens_per_micro_batch
            )
        ]
        metrics = self.policy.train_step(micro, sft_loss)
        metrics["tokens"] = float(sum(len(p.prompt) + len(p.completion) for p in pairs))
        metrics["completion_tokens"] = float(global_completion)
        metrics["data/overlong_dropped"] = float(self.data.overlong.dropped)
        metrics["data/overlong_truncated"] = float(self.data.overlong.truncated)
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        if not self.data.eval:
            return {}
        result = self.evaluator.accuracy(
            self.policy, [e.prompt for e in self.data.eval], [e.reference for e in self.data.eval], [e.vision for e in self.data.eval]
        )
        self.recorded = result.samples  # greedy completions, reward 1 for an exact match
        return {"eval/accuracy": result.accuracy}


SPEC = AlgorithmSpec(
    "sft", SFTConfig, SFT, "supervised fine-tuning on prompt/completion pairs", data="completions",
)
