"""Hugging Face transformers model on FSDP2 (`fully_shard`), the default training backend.

It scores only completion tokens, packs shared prompts, sums gradients across ranks (losses are
globally normalised) and never puts the full model on any rank but 0. docs/internals/backends.md
covers the layout, start-up, precision, checkpointing, compilation, failures and the critic;
docs/backends.md is the user's guide.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from rltrain.backends.adamw import build_adamw
from rltrain.backends.base import (
    LogProbScorer,
    LossFn,
    LossMetrics,
    PolicyOutput,
    Scores,
    scored_output,
    wrong_scores_error,
)
from rltrain.backends.fsdp import checkpoint, export
from rltrain.backends.fsdp.compile_layers import compile_decoder_layers
from rltrain.backends.fsdp.context_parallel.sequence_split import SequenceSplit
from rltrain.backends.fsdp.context_parallel.ulysses import switch_to_ulysses_attention
from rltrain.backends.fsdp.groups import FSDPGroups
from rltrain.backends.fsdp.hf_scoring import (
    CompletionScorer,
    CompletionValuer,
    completion_positions,
    dummy_batch,
)
from rltrain.backends.fsdp.lora_base import AdaptersOff
from rltrain.backends.fsdp.micro_batches.attention_masks import use_flex_attention
from rltrain.backends.fsdp.micro_batches.flex_autocast import switch_to_flex_attention
from rltrain.backends.fsdp.micro_batches.layout import MicroBatchLayout
from rltrain.backends.fsdp.micro_batches.routing import recorded_experts
from rltrain.backends.fsdp.router_terms import with_router_terms
from rltrain.backends.fsdp.sharding import load_shards, shard_model
from rltrain.backends.lr_schedule import lr_at
from rltrain.backends.optimizer_state import move_optimizer_state
from rltrain.backends.value_head import new_value_head
from rltrain.config.group_options import FSDPBackendConfig
from rltrain.config.schema import LoraAdapterConfig, OptimConfig, SafetyConfig
from rltrain.data.batch import SequenceBatch
from rltrain.data.ragged import Ragged
from rltrain.models import lora, moe, vision
from rltrain.models.hf_io import load_causal_lm
from rltrain.runtime.precision import Precision, resolve_precision
from rltrain.safety.faults import FaultInjector
from rltrain.safety.guard import (
    ErrorBudget,
    MicroBatchGuard,
    StepErrors,
    fail_fast_enabled,
    guarded_micro_batch,
)
from rltrain.safety.metrics import reduce_metric_sums
from rltrain.safety.step import safe_optimizer_step


class FSDPEngine:
    """The TrainEngine protocol on Hugging Face transformers + FSDP2. `optim_cfg=None` builds a
    frozen engine (a reference); `value_head_seed` a critic (see the module docstring); `adapters`
    with a rank > 0 trains LoRA adapters drawn from `seed` on a frozen base (docs/lora.md)."""

    def __init__(
        self,
        model_dir: Path,
        backend_cfg: FSDPBackendConfig,
        optim_cfg: OptimConfig | None,
        max_steps: int,
        device: torch.device,
        precision: Precision | str = "fp32",
        safety: SafetyConfig | None = None,
        gradient_checkpointing: bool = False,
        value_head_seed: int | None = None,
        adapters: LoraAdapterConfig | None = None,
        seed: int = 0,
        value_head_bias: bool = True,
        faults: FaultInjector | None = None,
        freeze_vision: bool = True,
        router_losses: moe.RouterLosses | None = None,
        router_replay: bool = False,
        reads_routing: bool = True,
    ) -> None:
        self.router_replay = router_replay  # algo.router_replay: route recorded tokens as the engine did (docs/moe.md)
        # False for a model other than the one the rollout engine samples (a critic or reference of
        # its own `path`): the recorded experts are another model's.
        self.reads_routing = reads_routing
        self.faults = faults if faults is not None else FaultInjector()
        self.freeze_vision = freeze_vision
        self.router_losses = router_losses  # a MoE's (rltrain.models.moe); None: the checkpoint's own
        # backend.cp ranks split each sequence, one replica: `rank`/`world_size` count replicas (docs/long-sequences.md)
        self.cp = backend_cfg.cp
        self.global_rank = dist.get_rank()
        self.rank, self.world_size = self.global_rank // self.cp, dist.get_world_size() // self.cp
        self.device = device
        self.model_dir = Path(model_dir)
        self.optim_cfg = optim_cfg
        self.max_steps = max_steps
        self.trainable = optim_cfg is not None
        self.precision = precision if isinstance(precision, Precision) else resolve_precision(precision, device)
        self.sharded = dist.get_world_size() > 1
        safety = safety or SafetyConfig()
        self.fail_fast = fail_fast_enabled(safety.fail_fast)
        self.error_budget = ErrorBudget(safety.max_consecutive_errors)
        self._load_model(adapters, seed)
        self._build_scorer(backend_cfg, value_head_seed, value_head_bias)
        if gradient_checkpointing:
            self.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if backend_cfg.compile:  # before fully_shard (rltrain.backends.fsdp.compile_layers)
            compile_decoder_layers(vision.decoder_layers(self.lm))
        if not self.trainable:
            self.scorer.requires_grad_(False)
        # The group FSDP shards over (None with one rank: nothing is wrapped, nothing to tear down).
        self.groups: FSDPGroups | None = None
        if self.sharded:
            self._shard(backend_cfg, safety.collective_timeout_s, seed, value_head_seed)
        self.steps_taken = 0  # optimizer steps actually applied (skipped ones excluded)
        self.optimizer = self._build_optimizer()

    # --- build steps, in the order __init__ takes them -------------------------------------------

    def _load_model(self, adapters: LoraAdapterConfig | None, seed: int) -> None:
        """The Hugging Face model (sharded: on the meta device until `sharding` has placed it, so no
        rank holds the full model); with LoRA its linear layers become peft LoRA layers in place,
        before sharding (rltrain.models.lora)."""
        self.lm = load_causal_lm(self.model_dir, self.precision.param_dtype, on_meta=self.sharded)
        if self.freeze_vision:  # a vision-language model's tower and projector (none in a text-only model)
            vision.freeze_vision(self.lm)
        self.adapters = lora.add_adapters(self.lm, adapters) if adapters is not None and adapters.rank > 0 else None
        self.save_merged = adapters is not None and adapters.save_merged
        if not self.sharded:
            self.lm.to(self.device)
            if self.adapters is not None:
                lora.fill_adapters(self.lm, seed)
        self.text_config = self.lm.config.get_text_config()  # the config itself for a text-only model
        self.pad_id = int(self.text_config.pad_token_id or 0)
        self.tied = bool(self.lm.config.tie_word_embeddings)
        self.moe_info = moe.prepare_moe(self.lm, self.router_losses)
        # A MoE reads the engine's recorded routing of its batches: replays it with algo.router_replay,
        # and measures `moe/router_agreement` either way.
        self.replay = moe.RouterReplay(self.lm, self.router_replay) if self.moe_info is not None and self.reads_routing else None

    def _build_scorer(self, backend_cfg: FSDPBackendConfig, value_head_seed: int | None, value_head_bias: bool) -> None:
        """How a micro-batch meets the model (packed shared prompts, one padding-free row, length
        buckets, one rectangle; padding-free rows on CUDA run flex_attention: attention_masks) and
        what scores it: the LM head's log-probabilities, or a critic's value head."""
        device = self.device
        # Sharded, FSDP casts weights to the compute dtype; unsharded, autocast does (docstring).
        autocast = contextlib.nullcontext if self.sharded else partial(self.precision.autocast, device)
        moe = self.moe_info is not None
        flex = backend_cfg.padding_free and not moe and use_flex_attention(self.lm, device)
        self.layout = MicroBatchLayout.for_model(
            self.text_config,
            self.pad_id,
            device,
            self.sharded,
            moe,
            padding_free=backend_cfg.padding_free,
            share_prompts=backend_cfg.share_prompts,
            length_buckets=backend_cfg.length_buckets,
            image_token_id=vision.image_token_id(self.lm.config),
            round_packed_widths=flex or backend_cfg.compile,
        )
        if flex:  # under autocast too (one unsharded rank in bf16-mixed): rltrain.backends.fsdp.micro_batches.flex_autocast
            switch_to_flex_attention(self.lm)
        if self.cp > 1:  # attention across the split (rltrain.backends.fsdp.context_parallel.ulysses)
            switch_to_ulysses_attention(self.lm, self.cp)
        self.scores: Scores = "logps" if value_head_seed is None else "values"
        self.value_head_seed = value_head_seed
        self.scorer: CompletionScorer | CompletionValuer
        if value_head_seed is None:
            self.scorer = CompletionScorer(self.lm, self.moe_info, autocast, flex)
        else:
            head = new_value_head(
                self.text_config.hidden_size, value_head_seed, self.precision.param_dtype,
                "meta" if self.sharded else device, bias=value_head_bias,
            )
            self.scorer = CompletionValuer(self.lm, head, self.moe_info, autocast, flex)

    def _shard(
        self, backend_cfg: FSDPBackendConfig, timeout_s: float | None, seed: int, value_head_seed: int | None
    ) -> None:
        """fully_shard over a group of the engine's own, then each rank's shards filled."""
        self.groups = FSDPGroups(self.device.type, timeout_s=timeout_s, cp=self.cp)
        if self.cp > 1:
            self.scorer.split = SequenceSplit(self.groups, self.cp, self.global_rank % self.cp)
        shard_model(self.lm, self.scorer, self.groups, self.precision, backend_cfg)
        load_shards(
            self.lm, self.scorer, self.groups, self.model_dir, self.precision, self.device,
            self.adapters, seed, value_head_seed,
        )

    def _build_optimizer(self) -> torch.optim.Optimizer | None:
        """AdamW over the trainable parameters; None for a frozen engine."""
        if self.optim_cfg is None:
            return None
        return build_adamw(
            (p for p in self.scorer.parameters() if p.requires_grad), self.optim_cfg,
            lr=lr_at(0, self.optim_cfg, self.max_steps), backend_default="foreach",
        )

    def base_weights(self) -> LogProbScorer | None:
        """The base model scored with the adapters switched off: a LoRA policy's reference at no
        cost in memory. None without adapters."""
        return AdaptersOff(self, self.adapters) if self.adapters is not None else None

    def replica_group(self) -> dist.ProcessGroup | None:
        """The cp ranks of this replica (`TrainEngine.replica_group`); None at backend.cp=1, where
        every FSDP rank is its own replica."""
        return self.groups.cp_group if self.cp > 1 and self.groups is not None else None

    # --- scoring -------------------------------------------------------------------------------

    def _score(self, batch: SequenceBatch, with_entropy: bool) -> PolicyOutput:
        real = len(batch) > 0
        scored = batch if real else dummy_batch(self.pad_id)
        rects, order_N, padding_mask_BT = self.layout(scored)
        _, _, targets = completion_positions(scored)
        if self.replay is not None:
            self.replay.load(recorded_experts(scored, rects, order_N, self.device))
        # logps_N of a policy or reference, values_N of a critic (`self.scores`)
        scored_N, entropy_N, router = self.scorer(
            [r.to(self.device) for r in rects],
            targets.to(self.device),
            with_entropy,
            order_N.to(self.device) if order_N is not None else None,
            padding_mask_BT.to(self.device) if padding_mask_BT is not None else None,
        )
        if not real:
            # Keep the graph (so a zero loss still reaches every parameter) but hold no sequences.
            empty_offsets = torch.zeros(1, dtype=torch.long)
            return scored_output(
                self.scores,
                Ragged(scored_N[:0], empty_offsets),
                Ragged(entropy_N[:0], empty_offsets) if entropy_N is not None else None,
                anchor=scored_N.sum() * 0.0,
                **moe.router_outputs(router, weight=0.0),
                router_agreement=None,
            )
        lengths = batch.completion_lens()
        return scored_output(
            self.scores,
            Ragged.from_lengths(scored_N, lengths),
            Ragged.from_lengths(entropy_N, lengths) if entropy_N is not None else None,
            **moe.router_outputs(router),
            router_agreement=self.replay.agreement() if self.replay is not None else None,
        )

    @torch.no_grad()
    def forward_logps(self, micro_batches: list[SequenceBatch], with_entropy: bool = False) -> list[PolicyOutput]:
        if self.scores != "logps":
            raise wrong_scores_error("FSDPEngine", self.scores, "forward_logps")
        self.scorer.eval()
        outs = []
        for mb in micro_batches:
            out = self._score(mb, with_entropy)
            assert out.logps is not None
            outs.append(PolicyOutput(out.logps.detach(), out.entropy.detach() if out.entropy is not None else None))
        return outs

    @torch.no_grad()
    def forward_values(self, micro_batches: list[SequenceBatch]) -> list[Ragged]:
        if self.scores != "values":
            raise wrong_scores_error("FSDPEngine", self.scores, "forward_values")
        self.scorer.eval()
        outs = []
        for mb in micro_batches:
            values = self._score(mb, with_entropy=False).values
            assert values is not None
            outs.append(values.detach())
        return outs

    def train_step(
        self, micro_batches: list[SequenceBatch], loss_fn: LossFn, with_entropy: bool = False
    ) -> dict[str, float]:
        assert self.optimizer is not None and self.optim_cfg is not None, "train_step on a frozen engine"
        if with_entropy and self.scores == "values":
            raise ValueError("train_step(with_entropy=True) on a critic engine: a critic has no entropy")
        self.scorer.train()
        lr = lr_at(self.steps_taken, self.optim_cfg, self.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        sums: dict[str, torch.Tensor] = {}
        errors = StepErrors(self.global_rank, self.fail_fast)
        injector = self.faults
        share = 1.0 / (len(micro_batches) * self.world_size)  # per-micro-batch means -> one global mean
        for i, mb in enumerate(micro_batches):
            done = guarded_micro_batch(
                MicroBatchGuard(self.scorer),
                errors,
                forward=partial(self._score, mb, with_entropy),
                loss_fn=partial(self._train_loss, mb=mb, loss_fn=loss_fn, share=share, injector=injector),
                dummy_forward=lambda: self._score(dummy_batch(self.pad_id), with_entropy=False),
                before_backward=injector.arm_backward,
                where=f"micro-batch {i} of step {injector.step}",
            )
            if done is None:
                continue  # recovered: this micro-batch contributes a zero gradient and no metrics
            loss, metrics = done
            sums["loss"] = sums.get("loss", torch.zeros((), dtype=torch.float64)) + loss.detach().double()
            for key, value in metrics.items():
                sums[key] = sums.get(key, torch.zeros((), dtype=torch.float64)) + torch.as_tensor(value).detach().double()
        sums["safety/recovered_errors"] = torch.tensor(float(errors.recovered), dtype=torch.float64)
        injector.poison_grads(self.scorer.parameters())
        outcome = safe_optimizer_step(self.optimizer, self.scorer.parameters(), self.optim_cfg.max_grad_norm)
        if not outcome.skipped:
            self.steps_taken += 1
        # cp peers hold identical sums (the same gathered scores, the same loss): one copy counts
        reduced = {k: v / self.cp for k, v in reduce_metric_sums(sums, partial=errors.recovered > 0).items()}
        agreed, recorded = reduced.pop("moe/router_agreed", 0.0), reduced.pop("moe/router_recorded", 0.0)
        if recorded > 0:  # token-layer pairs over every rank's micro-batches (docs/moe.md, "Router replay")
            reduced["moe/router_agreement"] = agreed / recorded
        self.error_budget.update(reduced["safety/recovered_errors"])
        reduced["grad_norm"] = outcome.grad_norm
        reduced["lr"] = lr
        reduced["safety/skipped_steps"] = float(outcome.skipped)
        return reduced

    def _train_loss(
        self, out: PolicyOutput, mb: SequenceBatch, loss_fn: LossFn, share: float, injector: FaultInjector
    ) -> tuple[torch.Tensor, LossMetrics]:
        """The algorithm's loss plus the dummy-batch anchor and, for a MoE model, its weighted
        router losses (per-micro-batch means, scaled so the sum over micro-batches and ranks is the
        mean) and load imbalance (docs/moe.md)."""
        injector.in_loss()
        loss, metrics = loss_fn(out, mb)
        if out.anchor is not None:
            loss = loss + out.anchor
        if self.moe_info is not None:
            loss, metrics = with_router_terms(loss, metrics, out, self.moe_info, share)
        return loss, metrics

    # --- weights out ---------------------------------------------------------------------------

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """With LoRA, the adapters merged into the base (docs/lora.md, "Weight sync")."""
        if self.scores == "values":
            raise TypeError(
                "FSDPEngine.export_weights: a critic or a reward model is not synced to a rollout engine (none runs "
                "it); save_pretrained writes a reward model as a sequence classifier"
            )
        yield from export.hf_weights(self.lm, self.adapters, self.tied, not self.faults.adapters_dropped())

    def save_pretrained(self, directory: Path) -> None:
        """A Hugging Face model directory; with LoRA a PEFT adapter directory, plus the merged
        model in `merged/` when `model.lora.save_merged` (docs/lora.md, "Outputs"). A reward model
        is written as a sequence classifier with one output (a vision-language one as its model
        plus the head's file), with LoRA its adapters merged; a critic is refused
        (`export.save_sequence_classifier`)."""
        if isinstance(self.scorer, CompletionValuer):
            export.save_sequence_classifier(directory, self.lm, self.adapters, self.scorer.value_head, self.global_rank, self.tied)
            return
        export.save_pretrained(
            directory, self.lm, self.adapters, self.save_merged, self.tied, self.model_dir, self.global_rank,
            with_adapters=not self.faults.adapters_dropped(),
        )

    # --- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, directory: Path) -> None:
        checkpoint.save(directory, self.scorer, self.optimizer, self.adapters, self.steps_taken, self.global_rank)

    def load_checkpoint(self, directory: Path) -> None:
        self.steps_taken = checkpoint.load(directory, self.scorer, self.optimizer, self.adapters)

    # --- time sharing --------------------------------------------------------------------------

    def offload(self) -> None:
        """Drop gradients; on GPU also move parameters and optimizer state to host memory (on CPU
        there is nowhere else to put them)."""
        for p in self.scorer.parameters():
            p.grad = None
        if self.device.type == "cuda":
            self.scorer.to("cpu")
            move_optimizer_state(self.optimizer, "cpu")

    def onload(self) -> None:
        if self.device.type == "cuda":
            self.scorer.to(self.device)
            move_optimizer_state(self.optimizer, self.device)

    def teardown_communicators(self) -> None:
        """Destroy the group FSDP shards over (collective). Export weights before: `full_tensor`
        needs it. No-op with one rank."""
        if self.groups is not None:
            self.groups.teardown()

    def recreate_communicators(self) -> int:
        """Re-create the group and re-bind FSDP's cached handles (collective); returns how many."""
        return self.groups.recreate() if self.groups is not None else 0
