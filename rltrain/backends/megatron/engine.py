"""MegatronEngine: the TrainEngine protocol on a megatron-core GPTModel with TP x PP x DP.

The engine ties together the modules of this package (stage_build, batching, schedule, logprobs,
grads, optim, convert, export, checkpoint, groups) behind the same protocol as the FSDP engine,
policy or critic. docs/internals/backends.md says what one call does, where each piece lives and
the contract that every rank of a replica receives the same micro-batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from rltrain.backends.adamw import build_adamw
from rltrain.backends.base import LossFn, PolicyOutput, Scores, wrong_scores_error
from rltrain.backends.lr_schedule import lr_at
from rltrain.backends.megatron import checkpoint, export
from rltrain.backends.megatron.batching import PaddedMicroBatch, check_same_data, pad_micro_batch
from rltrain.backends.megatron.convert import OUTPUT, is_expert, partial_under_tp
from rltrain.backends.megatron.cpu_shims import apply_cpu_shims
from rltrain.backends.megatron.grads import (
    all_finite,
    clip_,
    fill_missing_grads,
    global_grad_norm,
    norm_counted,
    sum_expert_grads,
    sum_over_data_parallel,
    sum_tensor_parallel_partials,
    sync_tied_embedding,
)
from rltrain.backends.megatron.groups import ParallelCoords, ParallelGroups
from rltrain.backends.megatron.guarded_losses import GuardedLosses
from rltrain.backends.megatron.hf_source import checked_spec
from rltrain.backends.megatron.logprobs import head_logps
from rltrain.backends.megatron.metrics import reduce_metrics
from rltrain.backends.megatron.router_replay import MegatronRouterReplay, agreement_counts, select_routing
from rltrain.backends.megatron.router_terms import router_capture
from rltrain.backends.megatron.schedule import Pipeline, run_pipeline, stage_pipeline
from rltrain.backends.megatron.stage_build import built_stage, engine_precision, join_groups, load_hf_weights
from rltrain.backends.optimizer_state import move_optimizer_state
from rltrain.backends.roles import engine_options, role_build
from rltrain.backends.sequence_classifier import CRITIC_NOT_EXPORTED
from rltrain.backends.value_head import head_values
from rltrain.config.algorithms import spec_of
from rltrain.config.group_options import MegatronBackendConfig
from rltrain.config.run_context import RunContext, SharedObjects
from rltrain.config.schema import OptimConfig, SafetyConfig
from rltrain.data.batch import SequenceBatch
from rltrain.data.ragged import Ragged
from rltrain.models import moe
from rltrain.models.vision import refuse_on_megatron
from rltrain.runtime.distributed import control_device
from rltrain.runtime.precision import Precision
from rltrain.safety.faults import FaultInjector
from rltrain.safety.guard import ErrorBudget, fail_fast_enabled


class MegatronEngine:
    """See the module docstring. `optim_cfg=None` builds a frozen engine (a reference policy);
    `value_head_seed` a critic."""

    def __init__(
        self,
        model_dir: str | Path,
        backend_cfg: MegatronBackendConfig,
        optim_cfg: OptimConfig | None,
        max_steps: int = 1,
        device: torch.device | None = None,
        precision: Precision | str = "fp32",
        *,
        collective_timeout_s: float | None = None,
        groups: ParallelGroups | None = None,
        shared: SharedObjects | None = None,
        safety: SafetyConfig | None = None,
        gradient_checkpointing: bool = False,
        value_head_seed: int | None = None,
        value_head_bias: bool = True,
        faults: FaultInjector | None = None,
        router_replay: bool = False,
        reads_routing: bool = True,
        router_losses: moe.RouterLosses | None = None,
    ) -> None:
        """`groups`: megatron's parallel state to join (a run's engines share one, so a policy and
        its frozen reference share one set of communicators); else the one `shared` holds (a run's
        `RunContext.shared`: the first engine creates it), else one created for this engine.
        `precision`: see `rltrain.runtime.precision` (parameters in its parameter dtype, each stage's
        forward autocast to its compute dtype when they differ); `gradient_checkpointing`: see
        `model.checkpoint_layers`. `value_head_bias=False`: a reward model's head, exported as a
        sequence classifier's score layer (`save_pretrained`). A MoE engine reads its batches' recorded
        routing where `reads_routing` (the policy's own model): it replays it with `router_replay`
        (`algo.router_replay`) and measures `moe/router_agreement` either way (docs/moe.md).
        `router_losses`: a MoE's `model.moe.*_loss_coef` as the run resolves them (`router_terms`)."""
        apply_cpu_shims()
        self.faults = faults if faults is not None else FaultInjector()
        self.model_dir = Path(model_dir)
        tp, pp, ep = backend_cfg.tp, backend_cfg.pp, backend_cfg.ep
        self.spec = checked_spec(self.model_dir, tp, pp, ep)
        self.groups = join_groups(groups, shared, tp, pp, collective_timeout_s, ep)
        self.precision = engine_precision(precision, device)
        self.scores: Scores = "logps" if value_head_seed is None else "values"
        critic = value_head_seed is not None  # a value model: a critic, or a reward model
        self.reward_model = critic and not value_head_bias
        # A critic's stage is built untied: its last stage holds a value head, no embedding copy.
        build_spec = dataclasses.replace(self.spec, tie_embeddings=False) if critic else self.spec
        self.model = built_stage(
            build_spec, self.coords, self.precision, value_model=critic, device=device,
            gradient_checkpointing=gradient_checkpointing, value_head_bias=value_head_bias,
        )
        load_hf_weights(self.model, self.spec, self.model_dir, self.coords, value_head_seed, value_head_bias)
        self.replay = (
            MegatronRouterReplay(self.model, router_replay, self.spec.num_layers)
            if self.spec.moe is not None and reads_routing else None
        )
        self.router = router_capture(self.model, self.spec, router_losses, self.model_dir, pp)
        self.params = list(self.model.parameters())
        # A MoE's experts differ between the ranks of an expert-parallel group (grads.py)
        self.dense_params = [p for n, p in self.model.named_parameters() if not is_expert(n)]
        self.expert_params = [p for n, p in self.model.named_parameters() if is_expert(n)]
        self.tp_partial_params = [p for n, p in self.model.named_parameters() if partial_under_tp(n)]
        # The tied embedding's copy on the last stage of a pipeline (a policy's, never a critic's).
        self.tied_copies = build_spec.tie_embeddings and pp > 1
        self._norm_params = self._norm_counted_params()
        self.optim_cfg, self.max_steps = optim_cfg, max_steps
        self.optimizer = (
            build_adamw(self.params, optim_cfg, lr=optim_cfg.lr, backend_default="for-loop") if optim_cfg is not None else None
        )
        if self.optimizer is None:
            self.model.requires_grad_(False)
        self.steps_taken = 0  # optimizer steps actually applied (skipped ones excluded)
        safety = safety or SafetyConfig()
        self.fail_fast = fail_fast_enabled(safety.fail_fast)
        self.error_budget = ErrorBudget(safety.max_consecutive_errors)
        self.groups.attach(self.model)
        self.rank = self.coords.dp_rank
        self.world_size = self.coords.dp

    def _norm_counted_params(self) -> list[torch.nn.Parameter]:
        """The parameters the gradient norm counts on this rank (`grads.norm_counted`)."""
        tied_copy_name = OUTPUT if self.tied_copies else None
        tp_rank = self.coords.tp_rank
        return [
            p for n, p in self.model.named_parameters()
            if not is_expert(n) and norm_counted(n, tp_rank, n == tied_copy_name)
        ]

    # -- coords -----------------------------------------------------------------------------

    @property
    def coords(self) -> ParallelCoords:
        if self.groups.coords is None:
            raise RuntimeError("the engine's process groups are torn down; call recreate_communicators() first")
        return self.groups.coords

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def base_weights(self) -> None:
        """Megatron trains every weight (model.lora is refused before anything is built)."""
        return None

    def replica_group(self) -> dist.ProcessGroup | None:
        """The tp x pp ranks of this rank's data-parallel replica (they must see the same data),
        or None when a replica is a single rank. Re-read each time: time sharing re-creates it."""
        coords = self.coords
        return coords.mp_group if coords.tp * coords.pp > 1 else None

    def _pipeline(self) -> Pipeline:
        return stage_pipeline(self.coords, self.spec.hidden_size, self.precision, self.device)

    def _score(
        self, mb: PaddedMicroBatch, stage_out: torch.Tensor, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scored [N], entropy [N] or None) from the last stage's output: log-probabilities from
        final hidden states [B, T, H] through the vocab-parallel output layer (`logprobs.head_logps`),
        or a critic's fp32 values from its final hidden states [T, B, H] (no entropy)."""
        if self.scores == "values":
            hidden_NH = stage_out[mb.cols_N, mb.rows_N]
            return head_values(self.model.value_head, hidden_NH), None
        coords = self.coords
        hidden_NH = stage_out[mb.rows_N, mb.cols_N]  # the positions that predict completion tokens
        return head_logps(
            self.model, hidden_NH, mb.targets_N, coords.tp_rank, self.spec.vocab_size, coords.tp_group,
            with_entropy, partial(self.precision.autocast, self.device),
        )

    # -- TrainEngine ------------------------------------------------------------------------

    def forward_logps(self, micro_batches: list[SequenceBatch], with_entropy: bool = False) -> list[PolicyOutput]:
        if self.scores != "logps":
            raise wrong_scores_error("MegatronEngine", self.scores, "forward_logps")
        return [
            PolicyOutput(logps=scored, entropy=entropy) for scored, entropy in self._forward(micro_batches, with_entropy)
        ]

    def forward_values(self, micro_batches: list[SequenceBatch]) -> list[Ragged]:
        if self.scores != "values":
            raise wrong_scores_error("MegatronEngine", self.scores, "forward_values")
        return [values for values, _ in self._forward(micro_batches, with_entropy=False)]

    def _forward(
        self, micro_batches: list[SequenceBatch], with_entropy: bool
    ) -> list[tuple[Ragged, Ragged | None]]:
        """(scored, entropy or None) per micro-batch without gradients, the same on every rank."""
        check_same_data(micro_batches, self.coords)
        padded = [pad_micro_batch(mb, self.device) for mb in micro_batches]
        pipe = self._pipeline()
        scored: list[torch.Tensor | None] = [None] * len(padded)

        def on_output(i: int, stage_out: torch.Tensor) -> None:
            scored_N, entropy_N = self._score(padded[i], stage_out, with_entropy)
            scored[i] = torch.stack([scored_N, entropy_N]) if entropy_N is not None else scored_N.unsqueeze(0)

        routing = select_routing(self.replay, micro_batches, padded)
        run_pipeline(self.model, pipe, padded, on_output, train=False, before_pass=routing)
        outputs = []
        for i, mb in enumerate(padded):
            values_KN = scored[i]
            if pipe.size > 1:  # the last stage scored; every stage returns the same outputs
                if values_KN is None:
                    k = 2 if with_entropy else 1
                    values_KN = torch.empty(k, mb.targets_N.numel(), dtype=torch.float32, device=self.device)
                src = dist.get_process_group_ranks(pipe.group)[-1]
                dist.broadcast(values_KN, src=src, group=pipe.group)
            assert values_KN is not None
            if mb.is_dummy:
                values_KN = values_KN[:, :0]
            lens = mb.completion_lens_B
            outputs.append(
                (
                    Ragged.from_lengths(values_KN[0], lens),
                    Ragged.from_lengths(values_KN[1], lens) if with_entropy else None,
                )
            )
        return outputs

    def train_step(
        self, micro_batches: list[SequenceBatch], loss_fn: LossFn, with_entropy: bool = False
    ) -> dict[str, float]:
        """One optimizer step. The loss and the last stage's backward of each micro-batch run under
        `rltrain.safety.guard` (see `GuardedLosses`): in recover mode a failed micro-batch contributes a
        zero gradient and every pipeline send/recv and TP collective is still matched."""
        if self.optimizer is None:
            raise RuntimeError("this MegatronEngine is frozen (built without optim_cfg)")
        if with_entropy and self.scores == "values":
            raise ValueError("train_step(with_entropy=True) on a critic engine: a critic has no entropy")
        check_same_data(micro_batches, self.coords)
        coords = self.coords
        padded = [pad_micro_batch(mb, self.device) for mb in micro_batches]
        for p in self.params:
            p.grad = None
        share = 1.0 / (max(len(padded), 1) * coords.dp)  # per-micro-batch means -> one global mean (router terms)
        router = partial(self.router.with_losses, share=share) if self.router is not None else None
        guarded = GuardedLosses(
            self._score, self.scores, self.coords, self.fail_fast, padded, micro_batches, loss_fn, self.faults,
            with_entropy, router,
        )
        if self.router is not None:
            self.router.begin(padded)
        try:
            run_pipeline(
                self.model, self._pipeline(), padded, guarded.on_output, train=True, on_backward=guarded.on_backward,
                before_pass=select_routing(self.replay, micro_batches, padded),
            )
        finally:
            if self.router is not None:
                self.router.end()
        recovered, mixed = guarded.errors.recovered, guarded.mixed
        if coords.tp > 1:  # each error is counted once, by the TP rank that had it
            both = torch.tensor([float(recovered), float(mixed)], dtype=torch.float64, device=control_device())
            dist.all_reduce(both, group=coords.tp_group)
            recovered, mixed = int(both[0]), bool(both[1] > 0)
        sums = guarded.sums
        sums["safety/recovered_errors"] = float(recovered)
        if self.replay is not None:
            sums.update(agreement_counts(self.replay, coords))
        if self.router is not None:
            sums["moe/load_imbalance"] = self.router.step_load_imbalance(padded, coords, share)
        guarded.injector.poison_grads(self.params)
        grad_norm, lr, stepped = self._optimizer_step(coords, force_skip=mixed)
        metrics = reduce_metrics(sums, coords, partial=recovered > 0)
        agreed, recorded = metrics.pop("moe/router_agreed", 0.0), metrics.pop("moe/router_recorded", 0.0)
        if recorded > 0:  # (token, layer) pairs over every replica's micro-batches (docs/moe.md, "Router replay")
            metrics["moe/router_agreement"] = agreed / recorded
        self.error_budget.update(metrics["safety/recovered_errors"])
        metrics.update({"grad_norm": grad_norm, "lr": lr, "safety/skipped_steps": 0.0 if stepped else 1.0})
        return metrics

    def _optimizer_step(self, coords: ParallelCoords, force_skip: bool = False) -> tuple[float, float, bool]:
        """`force_skip`: this rank's gradients are known to be inconsistent with its TP peers'
        (see `GuardedLosses.mixed`); it votes "not finite", so every rank skips the step together."""
        assert self.optimizer is not None and self.optim_cfg is not None
        fill_missing_grads(self.params)
        if self.tp_partial_params:
            sum_tensor_parallel_partials(self.tp_partial_params, coords.tp_group)
        sum_over_data_parallel(self.dense_params, coords.dp_group)
        if self.expert_params:
            sum_expert_grads(self.expert_params, coords.expert_dp_group, coords.tp)
        if self.tied_copies:
            sync_tied_embedding(self.model.shared_embedding_or_output_weight(), coords.embd_group)
        experts = self.expert_params if self.spec.moe is not None else None
        norm = float(global_grad_norm(self._norm_params, coords.mp_group, experts, coords.expert_mp_group))
        lr = lr_at(self.steps_taken, self.optim_cfg, self.max_steps)
        stepped = all_finite(float("nan") if force_skip else norm)
        if stepped:
            clip_(self.params, norm, self.optim_cfg.max_grad_norm)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.steps_taken += 1
        for p in self.params:
            p.grad = None
        return norm, lr, stepped

    def export_weights(self, to_rank0: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under HF names. Collective: every rank must exhaust the iterator.

        Default: every rank yields every tensor (weight sync). `to_rank0=True`: only global rank 0
        yields (saving), and only data-parallel replica 0 communicates.
        """
        self._refuse_critic_export("export_weights")
        return export.export_weights(self.model, self.spec, self.coords, to_rank0=to_rank0)

    def save_pretrained(self, directory: Path) -> None:
        """A Hugging Face causal LM directory; a reward model's a one-output sequence classifier
        (`export.save_sequence_classifier`); a critic is refused."""
        if self.reward_model:
            export.save_sequence_classifier(self.model, self.spec, self.coords, self.model_dir, Path(directory))
            return
        self._refuse_critic_export("save_pretrained")
        export.save_pretrained(self.model, self.spec, self.coords, self.model_dir, Path(directory))

    def _refuse_critic_export(self, called: str) -> None:
        if self.scores == "values":
            raise TypeError(
                f"MegatronEngine.{called}: a value model's weights are not synced or saved as a causal LM (its value "
                f"head has no place in one, and no rollout engine needs it); {CRITIC_NOT_EXPORTED}. A reward model's "
                "save_pretrained writes a sequence classifier"
            )

    def save_checkpoint(self, directory: Path) -> None:
        checkpoint.save(Path(directory), self.model, self.optimizer, self.coords, self.steps_taken)

    def load_checkpoint(self, directory: Path) -> None:
        self.steps_taken = checkpoint.load(Path(directory), self.model, self.optimizer, self.coords)

    def offload(self) -> None:
        """Free gradients; on CUDA also move parameters and AdamW moments to the host."""
        for p in self.params:
            p.grad = None
        if self.device.type == "cuda":
            self._move("cpu")

    def onload(self) -> None:
        if torch.cuda.is_available() and self.device.type == "cpu":
            self._move(torch.device("cuda", torch.cuda.current_device()))

    def _move(self, device) -> None:
        for p in self.params:
            p.data = p.data.to(device, non_blocking=True)
        move_optimizer_state(self.optimizer, device)
        if device != "cpu":
            torch.cuda.synchronize()

    # -- time sharing -----------------------------------------------------------------------

    def teardown_communicators(self) -> None:
        """Destroy every process group this backend created (see `groups`). Collective."""
        self.groups.teardown()

    def recreate_communicators(self) -> int:
        """Re-create the same groups and re-bind the handles held by every engine sharing them
        (their models). Collective. Returns how many handle references were re-bound."""
        return self.groups.recreate()


def build_engine(ctx: RunContext, role: str, max_steps: int) -> MegatronEngine:
    """The backend registry's entry (`backend=megatron`) for one role (rltrain.backends.Role);
    every role's engine joins the process groups the run holds (created by the first)."""
    cfg = ctx.cfg
    build = role_build(ctx, role)
    refuse_on_megatron(build.model_dir)
    return MegatronEngine(
        build.model_dir, cfg.backend, build.optim, max_steps, ctx.dist.device,
        collective_timeout_s=cfg.safety.collective_timeout_s, shared=ctx.shared,
        router_replay=bool(cfg.algo.get("router_replay", False)),  # an RL algorithm's key (algos/rl/config.py)
        reads_routing=Path(build.model_dir) == Path(ctx.model_dir), **engine_options(ctx, build),
        router_losses=moe.router_losses(
            cfg.model.moe.aux_loss_coef, float(cfg.model.moe.z_loss_coef), spec_of(cfg.algo.name).generates
        ),
    )
