"""The vLLM rollout engine: in-process vLLM, weights updated in place after every optimizer step.

It guarantees that vLLM's log-probability of each sampled token equals the trainer's
temperature-1 log-softmax to fp32 round-off, so the importance ratio is exact; each choice behind
that (raw log-probs, in-place reload, the tied-head repack, sleep mode, CPU vs CUDA, process-wide
state) is explained in docs/internals/rollout.md.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterable
from contextlib import nullcontext
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from rltrain.config.group_options import VLLMRolloutConfig
from rltrain.config.run_context import RunContext
from rltrain.models.vision import image_token_id
from rltrain.rollout import vllm_routing
from rltrain.rollout.base import Completion, SamplingSettings, exclusive
from rltrain.rollout.images import PromptImages, check_batch, expanded_prompt, vllm_prompt
from rltrain.rollout.seeds import request_seed
from rltrain.rollout.vllm_args import cpu_kv_cache_bytes, engine_kwargs, set_vllm_env
from rltrain.rollout.vllm_cpu_sampler import use_eager_rank_count
from rltrain.rollout.vllm_process_state import (
    ProcessStateGuard,
    collections_deferred,
    destroy_vllm_world_only,
    heap_frozen_for_construction,
    register_kernel_overrides_once,
)
from rltrain.rollout.vllm_reload import (
    SyncPlan,
    build_plan,
    checkpoint_names,
    forget_moe_kernels,
    record_names,
)
from rltrain.runtime.library_noise import quiet_vllm_import
from rltrain.runtime.precision import resolve_precision
from rltrain.runtime.process_state import owe_collection

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.inputs import TokensPrompt


def prefill_waves(prompt_lens: list[int], n: int, max_num_seqs: int, token_budget: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of prompts to generate one engine call each, so that the CPU build never
    prefills a seeded request in chunks: it rewinds the request's generator for a partial prefill,
    which a CPU generator cannot do (the engine raises). A call is safe when every request it admits
    fits the step's token budget whole: at most `max_num_seqs` requests (`n` per prompt) at the
    longest prompt's length within `token_budget`. One call when that holds for the whole batch (the
    common case, same batching as ever); else the fewest consecutive waves that each hold. Each
    request is seeded by its own index, so the split changes no sample's seed."""
    longest = max(prompt_lens, default=0)
    if min(len(prompt_lens) * n, max_num_seqs) * longest <= token_budget:
        return [(0, len(prompt_lens))]
    waves: list[tuple[int, int]] = []
    lo, tokens = 0, 0
    for i, length in enumerate(prompt_lens):
        if i > lo and ((i - lo + 1) * n > max_num_seqs or tokens + n * length > token_budget):
            waves.append((lo, i))
            lo, tokens = i, 0
        tokens += n * length
    waves.append((lo, len(prompt_lens)))
    return waves


class VLLMRolloutEngine:
    """`RolloutEngine` backed by an in-process `vllm.LLM`."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: VLLMRolloutConfig,
        seed: int = 0,
        *,
        dtype: str = "float32",
    ) -> None:
        self._gate = threading.RLock()  # ping() vs the training loop (rollout.base.exclusive)
        self.model_dir = Path(model_dir)
        self.cfg = cfg
        self.asleep = False
        set_vllm_env(cpu_kv_cache_bytes(cfg, model_dir, dtype))
        quiet_vllm_import()
        use_eager_rank_count()  # no inductor kernel to build in this process (vllm_cpu_sampler.py)
        register_kernel_overrides_once()
        from vllm import LLM
        from vllm.platforms import current_platform

        self.device_type = current_platform.device_type  # "cpu" on the CPU build, "cuda" on CUDA and ROCm
        kwargs = engine_kwargs(cfg, self.model_dir, dtype, self.device_type, seed)
        self.has_sleep_mode = bool(kwargs.get("enable_sleep_mode", False))
        # Sleep level 2 on an accelerator discards the weights: every wake needs a full load.
        self.weights_survive_sleep = not (self.has_sleep_mode and cfg.sleep_level == 2)
        self.weights_discarded = False  # asleep at level 2, or woken and not loaded yet
        self.kv_cache_asleep = False  # woken with tags=["weights"] only; the KV cache follows the load
        self.updated = False  # update_weights ran at least once (else the checkpoint on disk is current)
        # vLLM adopts an existing default process group as its world (new_group on it: every rank builds at once).
        self.owns_default_group = not torch.distributed.is_initialized()
        with heap_frozen_for_construction(self.device_type == "cpu"), ProcessStateGuard():  # frees a closed engine
            self.llm: LLM | None = LLM(**kwargs)
        hf_config = self._live().llm_engine.model_config.hf_config
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.image_token_id = image_token_id(hf_config)
        self.records_routing = vllm_routing.install_tap(self._live(), self.device_type)  # router replay's record
        self.expected_names = checkpoint_names(self.model_dir)
        if self.tied:
            self.expected_names.discard("lm_head.weight")
        # How vLLM names a Hugging Face tensor where a vision-language checkpoint and the trainer's model differ
        # (`model.layers.0...` vs `model.language_model.layers.0...`): asked of the worker only then (`_missing_names`).
        self._prefix_renames: dict[str, str | None] | None = None

    # --- generation -----------------------------------------------------------------------------

    @exclusive
    def generate(
        self, prompts: list[list[int]], sampling: SamplingSettings, images: list[PromptImages] | None = None
    ) -> list[Completion]:
        if self.asleep:
            raise RuntimeError("VLLMRolloutEngine.generate called while asleep; call wake() first")
        if self.weights_discarded:
            self._restore_checkpoint()
        from vllm import SamplingParams

        stop_ids = sorted(set(sampling.stop_token_ids))
        params = [
            SamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                seed=request_seed(sampling.seed, i, sampling.n),
                stop_token_ids=stop_ids or None,
                logprobs=0,  # only the sampled token's log-probability
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        check_batch(prompts, images)
        inputs = [
            cast("TokensPrompt", vllm_prompt(i, p, images[i] if images else None, self.image_token_id))
            for i, p in enumerate(prompts)
        ]
        waves = [(0, len(prompts))]
        if self.device_type == "cpu":
            scheduler = self._live().llm_engine.vllm_config.scheduler_config
            waves = prefill_waves([len(p) for p in prompts], sampling.n, scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
        outputs = []
        if self.records_routing:
            self._live().collective_rpc(vllm_routing.arm)
        with ProcessStateGuard():
            for lo, hi in waves:
                outputs += self._live().generate(inputs[lo:hi], params[lo:hi], use_tqdm=False)
        routing = self._live().collective_rpc(vllm_routing.take)[0] if self.records_routing else {}  # by seed
        completions: list[Completion] = []
        for i, out in enumerate(outputs):
            prompt_ids = None
            if images and images[i]:
                assert self.image_token_id is not None and out.prompt_token_ids is not None  # vllm_prompt checked
                prompt_ids = expanded_prompt(i, prompts[i], out.prompt_token_ids, self.image_token_id)
            for c in sorted(out.outputs, key=lambda c: c.index):
                token_ids = list(c.token_ids)
                assert c.logprobs is not None  # requested: SamplingParams(logprobs=0)
                logprobs = [float(c.logprobs[j][tok].logprob) for j, tok in enumerate(token_ids)]
                experts = vllm_routing.completion_routing(routing, cast(int, params[i].seed) + c.index, len(token_ids))
                completions.append(Completion(
                    i, token_ids, logprobs, c.finish_reason == "stop", prompt_ids=prompt_ids, routing=experts
                ))
        return completions

    # --- weights --------------------------------------------------------------------------------

    @exclusive
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload every tensor in place (Hugging Face names, full tensors), refresh a tied output
        head (a vision tower's tensors too), reset the prefix and encoder caches. The iterable must hold the
        whole checkpoint.

        Where the engine's `SyncPlan` applies (vllm_reload.py) it loads the update; an update it
        does not fit, or a model it does not support, goes through vLLM's layerwise reload."""
        if self.asleep and self.has_sleep_mode:  # the weights' memory is offloaded or gone
            raise RuntimeError("VLLMRolloutEngine.update_weights called while asleep; call wake() first")
        seen: set[str] = set()
        named: Iterable[tuple[str, torch.Tensor]] = record_names(weights, seen)
        if self.device_type != "cpu":
            self._reload_supported(named)
        else:
            plan = self._sync_plan
            if plan is not None:
                named = listed = list(named)  # the plan needs every tensor at once; a fallback reuses them
            if plan is None or not self._live().apply_model(partial(plan.load, weights=listed))[0]:
                self._live().apply_model(forget_moe_kernels)
                self._reload_in_place(named)
                if self.tied:
                    self._refresh_tied_head()
        if self.records_routing:
            self._live().collective_rpc(vllm_routing.rebind)
        self.updated = True
        self.weights_discarded = False
        self._wake_kv_cache()
        self._reset_weight_caches()
        missing = self._missing_names(seen)
        if missing:
            raise ValueError(
                f"update_weights received {len(seen)} tensors but not {sorted(missing)[:8]} "
                f"({len(missing)} missing). vLLM rebuilds a partially loaded layer from uninitialised "
                "memory, so this engine's weights are now undefined: send the complete set of weights "
                "in one update_weights call."
            )

    def _missing_names(self, seen: set[str]) -> set[str]:
        """The checkpoint's tensors no name in `seen` stands for, compared after vLLM's renaming of
        prefixes (its fusing of q/k/v names is left out: each part must come)."""
        unseen = self.expected_names - seen
        if not unseen:
            return set()
        if self._prefix_renames is None:
            self._prefix_renames = self._model_prefix_renames()
        renamed = {self._renamed(name) for name in seen}
        return {name for name in unseen if self._renamed(name) not in renamed}

    def _model_prefix_renames(self) -> dict[str, str | None]:
        """The prefixes the model class's Hugging Face to vLLM name mapping (vLLM's `WeightsMapper`,
        where it has one) renames, in its order: read from the class vLLM's registry resolves, so
        no worker is asked (on CUDA the workers are other processes)."""
        from vllm.model_executor.models.registry import ModelRegistry

        model_config = self._live().llm_engine.model_config
        try:
            model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
        except (ValueError, AttributeError):  # a class vLLM resolves otherwise: no renaming known
            return {}
        mapper = getattr(model_cls, "hf_to_vllm_mapper", None)
        return dict(mapper.orig_to_new_prefix) if mapper is not None else {}

    def _renamed(self, name: str) -> str | None:
        assert self._prefix_renames is not None
        for prefix, new in self._prefix_renames.items():
            if name.startswith(prefix):
                if new is None:
                    return None
                name = new + name[len(prefix) :]
        return name

    def _reload_in_place(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """vLLM's own in-place reload, nothing more (the tied head stays stale on CPU)."""

        def reload(worker, weights_iterator):
            worker.model_runner.reload_weights(weights_iterator=weights_iterator)

        self._live().collective_rpc(reload, args=(iter(weights),))

    def _reload_supported(self, weights: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        """vLLM's supported reload on an accelerator: the worker's `reload_weights` (layerwise: each
        layer rebuilt from Hugging Face-named tensors, then its `process_weights_after_loading`).
        None reloads the checkpoint the engine was built from. With tensor parallelism the workers
        are other processes and vLLM's RPC queue carries the arguments: a list, not a generator."""
        kwargs: dict[str, Any] = {}
        if weights is not None:
            kwargs["weights_iterator"] = list(weights) if self.cfg.tensor_parallel_size > 1 else iter(weights)
        self._live().collective_rpc("reload_weights", kwargs=kwargs)

    def _restore_checkpoint(self) -> None:
        """Generating after a level-2 sleep with nothing loaded since: before the first update the
        checkpoint on disk is this engine's weights, so load it (vLLM's documented level-2 wake);
        after one, the trainer's weights are unknown here and generating would use garbage."""
        if self.updated:
            raise RuntimeError(
                "sleep(level=2) discarded the engine's weights and no update_weights followed wake(): send the "
                "trainer's weights after every wake (time sharing does, for an engine whose "
                "weights_survive_sleep is false)"
            )
        self._reload_supported(None)
        self.weights_discarded = False
        self._wake_kv_cache()
        self._reset_weight_caches()

    def _reset_weight_caches(self) -> None:
        """Drop everything vLLM computed with the old weights: the prefix cache's KV blocks and the
        encoder cache's image embeddings (the reload empties the worker's encoder cache but not the
        scheduler's record of it, so the next image it thinks cached fails with "Encoder cache miss")."""
        self._live().reset_prefix_cache()
        self._live().llm_engine.reset_encoder_cache()

    def _wake_kv_cache(self) -> None:
        if self.kv_cache_asleep:
            self._live().wake_up(tags=["kv_cache"])
            self.kv_cache_asleep = False

    @cached_property
    def _sync_plan(self) -> SyncPlan | None:
        """The fast sync's plan for this engine's model, built on the first update; None if none applies."""
        return self._live().apply_model(partial(build_plan, names=self.expected_names))[0]

    def _refresh_tied_head(self) -> None:
        """Repack the output head from the (already reloaded) shared embedding parameter."""

        def refresh(model: torch.nn.Module) -> None:
            # vLLM's ParallelLMHead: `lm_head` of a causal LM, `language_model.lm_head` of a VLM (typed `Tensor | Module`).
            heads: list[Any] = [m for name, m in model.named_modules() if name.rpartition(".")[2] == "lm_head"]
            for head in heads:
                head.quant_method.process_weights_after_loading(head)

        self._live().apply_model(refresh)

    # --- time sharing and liveness --------------------------------------------------------------

    @exclusive
    def sleep(self) -> None:
        """Release the engine's accelerator memory where vLLM supports it (CUDA: `LLM.sleep` at
        `rollout.sleep_level`: 1 keeps a host copy of the weights, 2 drops them, and then a full
        `update_weights` must follow the wake). On CPU vLLM has no sleep mode: nothing is freed,
        only the phase is recorded."""
        if self.asleep:
            return
        if self.has_sleep_mode:
            self._live().sleep(level=self.cfg.sleep_level)
            self.weights_discarded = not self.weights_survive_sleep
        self.asleep = True

    @exclusive
    def wake(self) -> None:
        """Take the memory back. After a level-2 sleep only the weights' memory (vLLM's
        `wake_up(tags=["weights"])`); the KV cache is woken after the weights are loaded
        (`update_weights`, or the checkpoint reload before the first one), to lower the peak."""
        if not self.asleep:
            return
        if self.has_sleep_mode:
            if self.weights_discarded:
                self._live().wake_up(tags=["weights"])
                self.kv_cache_asleep = True
            else:
                self._live().wake_up()
        self.asleep = False

    def _live(self) -> LLM:
        if self.llm is None:
            raise RuntimeError("the vLLM engine is closed")
        return self.llm

    def metrics(self) -> dict[str, float]:
        return {}

    def ping(self) -> bool:
        """True when the engine core answers a no-op call on its worker (see `RolloutEngine.ping`:
        True without entering while the training loop is inside the engine). A failure raises,
        so the health check can name it."""
        if not self._gate.acquire(blocking=False):
            return True
        try:
            return all(self._live().collective_rpc(_pong))
        finally:
            self._gate.release()

    @exclusive
    def close(self) -> None:
        """Shut the engine down and free vLLM's distributed state, so another engine can be built here.

        vLLM's shutdown destroys the *default* process group, which is the trainer's where the trainer
        made it first (vLLM adopts it): only the groups vLLM made are destroyed then. On the CPU build
        one collection frees the engine, not vLLM's three (`collections_deferred`), owed to the
        process's next run or engine (rltrain.runtime.process_state); on CUDA it is made here."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        from vllm.distributed import parallel_state

        destroy_all = parallel_state.destroy_distributed_environment
        if not self.owns_default_group:
            parallel_state.destroy_distributed_environment = destroy_vllm_world_only
        try:
            with collections_deferred() if self.device_type == "cpu" else nullcontext():
                llm.llm_engine.engine_core.shutdown()
        finally:
            parallel_state.destroy_distributed_environment = destroy_all
            del llm
            owe_collection() if self.device_type == "cpu" else gc.collect()


def _pong(worker) -> bool:
    return True


def build_engine(ctx: RunContext) -> VLLMRolloutEngine:
    """The run's vLLM engine (for a lazy registry `"vllm": "rltrain.rollout.vllm:build_engine"`).
    Every rank builds one at the same time (vLLM calls `new_group` on the trainer's group)."""
    return VLLMRolloutEngine(
        ctx.model_dir, ctx.cfg.rollout, seed=ctx.cfg.rollout.seed,
        dtype=resolve_precision(ctx.cfg.trainer.precision, ctx.dist.device).compute_dtype_name,
    )
