"""The transformers rollout engine: `model.generate` on a private copy of the policy.

The fallback when vLLM is not installed or not wanted (`rollout=hf`); it honours the vLLM engine's
contract (raw log-probabilities, stop tokens, seeding, weight updates), so an algorithm cannot tell
them apart. It never imports vLLM. docs/internals/rollout.md lists the contract.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rltrain.config.group_options import HFRolloutConfig
from rltrain.config.run_context import RunContext
from rltrain.models import moe
from rltrain.models.vision import image_token_id
from rltrain.rollout.base import Completion, SamplingSettings, exclusive
from rltrain.rollout.hf_images import ImageInputs
from rltrain.rollout.images import PromptImages
from rltrain.runtime.precision import resolve_precision

if TYPE_CHECKING:
    from rltrain.models.hf_io import GenerativeLM


class HFRolloutEngine:
    """`RolloutEngine` backed by `transformers` `generate`."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: HFRolloutConfig,
        seed: int = 0,
        *,
        dtype: str = "float32",
        device: str | torch.device = "cpu",
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        self._gate = threading.RLock()  # ping() vs the training loop (rollout.base.exclusive)
        self.weights_survive_sleep = True  # sleep() moves the model to host memory and back
        self.cfg = cfg
        self.seed = seed
        self.device = torch.device(device)
        token_id = image_token_id(AutoConfig.from_pretrained(str(model_dir)))
        # A vision-language model generates with its images (rollout/hf_images.py).
        self.images = ImageInputs(model_dir, token_id) if token_id is not None else None
        auto = AutoModelForCausalLM if self.images is None else AutoModelForImageTextToText
        model = auto.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
        model.to(self.device).eval()
        model.requires_grad_(False)
        gen_cfg = model.generation_config
        text_config = model.config.get_text_config()  # a vision-language config keeps them on its text part
        eos = gen_cfg.eos_token_id if gen_cfg.eos_token_id is not None else text_config.eos_token_id
        self.eos_ids: list[int] = [eos] if isinstance(eos, int) else list(eos or [])
        pad = text_config.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0))
        # generate() fills every unset field from the model's generation_config (a checkpoint may
        # ship top_k, repetition_penalty, suppress_tokens, ...): give this private copy a blank one.
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig(eos_token_id=self.eos_ids or None, pad_token_id=self.pad_id)
        self.model: GenerativeLM | None = model  # None once closed
        self.asleep = False
        # A MoE's tensors whose checkpoint names are not the model's (its fused experts: rltrain.models.moe)
        self.expert_places = moe.checkpoint_places(model) if moe.is_moe(text_config) else {}
        # A MoE records every sampled token's experts, always: cheap, and what router replay and
        # `moe/router_agreement` read (docs/moe.md, "Router replay").
        self.routing = moe.RoutingRecorder(model) if moe.is_moe(text_config) else None

    def _live(self) -> GenerativeLM:
        if self.model is None:
            raise RuntimeError("the transformers rollout engine is closed")
        return self.model

    @exclusive
    def generate(
        self, prompts: list[list[int]], sampling: SamplingSettings, images: list[PromptImages] | None = None
    ) -> list[Completion]:
        if self.model is None:
            raise RuntimeError("HFRolloutEngine.generate called after close()")
        if self.asleep:
            raise RuntimeError("HFRolloutEngine.generate called while asleep; call wake() first")
        if not prompts:
            return []
        stop_ids = sorted(set(self.eos_ids) | set(sampling.stop_token_ids))
        expanded: list[list[int] | None] = [None] * len(prompts)
        if images is not None and any(images):
            if self.images is None:
                raise ValueError("generate got images but the rollout model is text-only: use a vision-language model")
            prompts, expanded = self.images.expand(prompts, images)
        rows = [list(p) for p in prompts for _ in range(sampling.n)]  # prompt-major
        input_ids_BT, mask_BT = self._left_pad(rows)
        row_images = [images[i] if images else [] for i in range(len(prompts)) for _ in range(sampling.n)]
        image_kwargs = self.images.tensors(row_images, input_ids_BT, mask_BT) if self.images is not None else {}
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.seed * 1_000_003 + sampling.seed)
            with self.routing.recording(len(rows)) if self.routing is not None else contextlib.nullcontext():
                out = self.model.generate(
                    input_ids=input_ids_BT,
                    attention_mask=mask_BT,
                    generation_config=self._generation_config(sampling, stop_ids),
                    **{k: v.to(self.device) for k, v in image_kwargs.items()},
                )
        assert not isinstance(out, torch.Tensor) and out.logits is not None  # return_dict_in_generate, output_logits
        new_tokens_BN = out.sequences[:, input_ids_BT.shape[1] :].cpu()
        logits_BNV = torch.stack(out.logits, dim=1).float().cpu()
        logps_BN = torch.log_softmax(logits_BNV, dim=-1).gather(-1, new_tokens_BN.unsqueeze(-1)).squeeze(-1)
        # [B, N, layers, k]: one forward per sampled token, the one whose logits sampled it
        experts_BNLK = self.routing.take() if self.routing is not None else None
        if experts_BNLK is not None and experts_BNLK.shape[1] != new_tokens_BN.shape[1]:
            raise RuntimeError(
                f"the transformers engine recorded {experts_BNLK.shape[1]} routed forwards for {new_tokens_BN.shape[1]} "
                "sampled tokens"
            )
        completions: list[Completion] = []
        stops = torch.tensor(stop_ids, dtype=torch.long)
        for row in range(len(rows)):
            tokens_N = new_tokens_BN[row]
            is_stop_N = torch.isin(tokens_N, stops)
            finished = bool(is_stop_N.any())
            length = int(is_stop_N.nonzero()[0, 0]) + 1 if finished else int(tokens_N.numel())
            completions.append(
                Completion(
                    prompt_index=row // sampling.n,
                    token_ids=tokens_N[:length].tolist(),
                    logprobs=logps_BN[row, :length].tolist(),
                    finished=finished,
                    prompt_ids=expanded[row // sampling.n],
                    routing=experts_BNLK[row, :length].clone() if experts_BNLK is not None else None,
                )
            )
        return completions

    def _left_pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, T] ids, [B, T] mask), padding on the left so every row ends at the same column."""
        width = max(len(r) for r in rows)
        ids_BT = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask_BT = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids_BT[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask_BT[i, width - len(r) :] = 1
        return ids_BT.to(self.device), mask_BT.to(self.device)

    def _generation_config(self, sampling: SamplingSettings, stop_ids: list[int]):
        """Plain sampling from softmax(logits / temperature) restricted by top-p, nothing else.
        Fields left unset would be filled by transformers' defaults (top_k=50!), so every knob
        that changes the sampled distribution is pinned here."""
        from transformers import GenerationConfig

        greedy = sampling.temperature <= 0.0
        return GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=0,
            do_sample=not greedy,
            temperature=1.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=0,
            typical_p=1.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            epsilon_cutoff=0.0,
            eta_cutoff=0.0,
            eos_token_id=stop_ids or None,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_logits=True,
        )

    @exclusive
    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full tensors into the model by Hugging Face name (there is no prefix cache). A MoE
        model's experts come under the checkpoint's per-expert names (rltrain.models.moe) and go
        into their elements of the fused parameters."""
        params = self._live().state_dict(keep_vars=True)
        for name, tensor in weights:
            if name in self.expert_places:
                self.expert_places[name].write(params, tensor)
                continue
            if name not in params:
                raise KeyError(f"update_weights: the rollout model has no tensor named {name!r}")
            target = params[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the rollout model "
                    f"expects {tuple(target.shape)}"
                )
            target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))

    @exclusive
    def sleep(self) -> None:
        """Move the model to host memory (accelerators only; on CPU nothing is freed)."""
        if self.device.type != "cpu" and not self.asleep:
            self._live().to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.asleep = True

    @exclusive
    def wake(self) -> None:
        if self.device.type != "cpu" and self.asleep:
            self._live().to(self.device)
        self.asleep = False

    def metrics(self) -> dict[str, float]:
        return {}

    def ping(self) -> bool:
        """A one-token forward through the model, whose logits must be finite (see
        `RolloutEngine.ping`: True without entering while the training loop is using the engine;
        asleep on an accelerator, the model's presence is checked, not run on the host)."""
        if not self._gate.acquire(blocking=False):
            return True
        try:
            if self.model is None:
                raise RuntimeError("the transformers rollout engine is closed")
            if self.asleep and self.device.type != "cpu":
                return True
            with torch.inference_mode():
                logits = self.model(input_ids=torch.tensor([[self.pad_id]], device=self.device)).logits
            if not bool(torch.isfinite(logits).all()):
                raise RuntimeError("the transformers rollout engine's model returns non-finite logits")
            return True
        finally:
            self._gate.release()

    @exclusive
    def close(self) -> None:
        self.model = None


def build_engine(ctx: RunContext) -> HFRolloutEngine:
    """The run's transformers engine (for a lazy registry `"hf": "rltrain.rollout.hf:build_engine"`)."""
    return HFRolloutEngine(
        ctx.model_dir,
        ctx.cfg.rollout,
        seed=ctx.cfg.rollout.seed,
        dtype=resolve_precision(ctx.cfg.trainer.precision, ctx.dist.device).compute_dtype_name,
        device=ctx.dist.device,
    )
