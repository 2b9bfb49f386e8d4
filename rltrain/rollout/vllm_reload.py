"""A fast in-place weight sync for vLLM's CPU build: rebuild each layer directly.

vLLM's generic layerwise reload spends most of a small model's sync on bookkeeping; a `SyncPlan`
does only the repacks and copies, bit-identical, for Qwen2/Llama on CPU, and anything it does not
fit falls back to vLLM's reload; and the names a checkpoint stores, for checking an update whole
(`checkpoint_names`, `record_names`). docs/internals/sync.md has what it handles, what it does not, its
memory cost and the measured timings.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# A vLLM model or layer: it carries attributes torch's Module does not declare
# (packed_modules_mapping, quant_method, org_vocab_size, output_size_per_partition, ...).
VLLMModule = Any


class UnsupportedModel(Exception):
    """The model (or checkpoint) is outside what `SyncPlan` handles; the reason is the message."""


@dataclass(frozen=True)
class _Copy:
    """A Hugging Face tensor copied in place into rows of a live parameter (norm, bias, embedding)."""

    name: str
    module: str
    param: str
    rows: slice


@dataclass(frozen=True)
class _Rebuild:
    """A linear layer whose full weight is assembled from Hugging Face tensors, each into its rows,
    then repacked by the layer's quant method."""

    module: str
    shape: tuple[int, int]
    dtype: torch.dtype
    parts: tuple[tuple[str, slice], ...]


@dataclass(frozen=True)
class SyncPlan:
    """Where every tensor of a checkpoint goes in a vLLM model, and what to repack afterwards.
    Holds module names, not modules, so it never keeps a closed engine's model alive."""

    shapes: dict[str, torch.Size]
    copies: tuple[_Copy, ...]
    rebuilds: tuple[_Rebuild, ...]
    repacks: tuple[str, ...]

    @classmethod
    def build(cls, model: VLLMModule, names: Iterable[str]) -> SyncPlan:
        """The plan for loading the checkpoint tensors `names` into `model`, or `UnsupportedModel`."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            raise UnsupportedModel(f"platform {type(current_platform).__name__} is not vLLM's CPU build")
        if type(model) not in _supported_models():
            raise UnsupportedModel(f"model class {type(model).__name__}")

        by_module = _by_module(model, names)
        shapes: dict[str, torch.Size] = {}
        copies: list[_Copy] = []
        rebuilds: list[_Rebuild] = []
        for path, params in by_module.items():
            module = _submodule(model, path)
            own = {name for name, _ in module.named_parameters(recurse=False)}
            if set(params) != own:
                raise UnsupportedModel(f"{path} has parameters {sorted(own)}, the checkpoint {sorted(params)}")
            if _is_linear(module):
                rebuilds.append(_plan_linear(path, module, params, shapes, copies))
            elif _is_embedding(module) and own == {"weight"}:
                name = _unfused(path, params["weight"])
                shapes[name] = torch.Size([module.org_vocab_size, module.embedding_dim])
                copies.append(_Copy(name, path, "weight", slice(0, module.org_vocab_size)))
            elif _is_norm(module) and own == {"weight"}:
                name = _unfused(path, params["weight"])
                shapes[name] = module.weight.shape
                copies.append(_Copy(name, path, "weight", slice(None)))
            else:
                method = type(getattr(module, "quant_method", None)).__name__
                raise UnsupportedModel(f"{path}: {type(module).__name__} with {method} is not a layer it rebuilds")

        for copy in copies:
            target = getattr(_submodule(model, copy.module), copy.param)[copy.rows]
            if target.shape != shapes[copy.name]:
                raise UnsupportedModel(f"{copy.name} is {tuple(shapes[copy.name])}, its target {tuple(target.shape)}")

        return cls(shapes, tuple(copies), tuple(rebuilds), tuple(_repacks(model, copies, by_module)))

    def load(self, model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> bool:
        """Load a whole checkpoint into `model`. False, with nothing changed, when `weights` are not
        exactly the planned names and shapes."""
        tensors = dict(weights)
        if tensors.keys() != self.shapes.keys() or any(
            tensors[name].shape != shape for name, shape in self.shapes.items()
        ):
            return False
        with torch.no_grad():
            for copy in self.copies:
                getattr(model.get_submodule(copy.module), copy.param)[copy.rows].copy_(tensors[copy.name])
            for rebuild in self.rebuilds:
                layer: VLLMModule = model.get_submodule(rebuild.module)
                weight = torch.empty(rebuild.shape, dtype=rebuild.dtype)
                for name, rows in rebuild.parts:
                    weight[rows].copy_(tensors[name])
                layer.weight = torch.nn.Parameter(weight, requires_grad=False)
                layer.quant_method.process_weights_after_loading(layer)
            for path in self.repacks:
                layer = model.get_submodule(path)
                layer.quant_method.process_weights_after_loading(layer)
        return True


def build_plan(model: torch.nn.Module, names: Iterable[str]) -> SyncPlan | None:
    """`SyncPlan.build`, or None (the reason logged) where it does not apply. Takes the model
    first, for `LLM.apply_model`, which runs it on the worker's model."""
    try:
        return SyncPlan.build(model, names)
    except UnsupportedModel as exc:
        log.info("weight sync falls back to vLLM's layerwise reload: %s", exc)
        return None


def forget_moe_kernels(model: torch.nn.Module) -> int:
    """Before vLLM's layerwise reload on CPU: make each unquantized MoE layer set its kernel up
    again, as on the first load. vLLM treats a reload as a weight update and copies the new
    experts into the existing storage, skipping the CPU kernel's prepack, so the experts it then
    runs are unpacked bytes read as packed ones (docs/moe.md, "Weight sync"). Returns the count."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    layers: list[VLLMModule] = [
        m for m in model.modules() if isinstance(getattr(m, "quant_method", None), UnquantizedFusedMoEMethod)
    ]
    for layer in layers:
        layer.quant_method.moe_kernel = None
    return len(layers)


def _supported_models() -> tuple[type, ...]:
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    return Qwen2ForCausalLM, LlamaForCausalLM


def _submodule(model: torch.nn.Module, path: str) -> VLLMModule:
    try:
        return model.get_submodule(path)
    except AttributeError as exc:
        raise UnsupportedModel(f"no module {path!r} in {type(model).__name__}") from exc


def _is_linear(module: torch.nn.Module) -> bool:
    """An unquantized, unsharded linear layer whose weight the CPU build repacked (left empty)."""
    from vllm.model_executor.layers import linear

    kinds = (
        linear.QKVParallelLinear,
        linear.MergedColumnParallelLinear,
        linear.ColumnParallelLinear,
        linear.RowParallelLinear,
        linear.ReplicatedLinear,
    )
    return bool(
        type(module) in kinds
        and type(module.quant_method) is linear.UnquantizedLinearMethod
        and module.tp_size == 1
        and isinstance(weight := module.weight, torch.Tensor)
        and weight.numel() == 0
    )


def _is_embedding(module: torch.nn.Module) -> bool:
    """An unquantized, unsharded embedding or output head (it keeps its weight, plus a packed copy)."""
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    return bool(
        type(module) in (vpe.VocabParallelEmbedding, vpe.ParallelLMHead)
        and type(module.quant_method) is vpe.UnquantizedEmbeddingMethod
        and module.tp_size == 1
    )


def _is_norm(module: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.layernorm import RMSNorm

    return type(module) is RMSNorm and bool(module.has_weight)


def _plan_linear(
    path: str,
    module: VLLMModule,
    params: dict[str, list[tuple[int | None, str]]],
    shapes: dict[str, torch.Size],
    copies: list[_Copy],
) -> _Rebuild:
    """A linear layer's weight parts (to rebuild) and bias parts (to copy in place, same rows)."""
    rows = _part_rows(path, module, [index for index, _ in params["weight"]])
    cols = module.input_size_per_partition
    for index, name in params["weight"]:
        shapes[name] = torch.Size([_length(rows[index]), cols])
    if "bias" in params:
        bias_indices = [index for index, _ in params["bias"]]
        if len(bias_indices) != len(rows) or set(bias_indices) != set(rows):
            raise UnsupportedModel(f"{path}: bias parts do not match weight parts")
        for index, name in params["bias"]:
            shapes[name] = torch.Size([_length(rows[index])])
            copies.append(_Copy(name, path, "bias", rows[index]))
    return _Rebuild(
        path,
        (module.output_size_per_partition, cols),
        module.weight.dtype,
        tuple((name, rows[index]) for index, name in params["weight"]),
    )


def _part_rows(path: str, module: torch.nn.Module, indices: list[int | None]) -> dict[int | None, slice]:
    """The output rows of each part of a linear layer: the whole weight for an unfused layer,
    consecutive blocks of `output_sizes` in `packed_modules_mapping` order for a fused one."""
    if indices == [None]:
        return {None: slice(0, module.output_size_per_partition)}
    sizes = list(getattr(module, "output_sizes", []))
    parts = sorted(index for index in indices if index is not None)
    if len(parts) != len(indices) or parts != list(range(len(sizes))) or (
        sum(sizes) != module.output_size_per_partition
    ):
        raise UnsupportedModel(f"{path}: parts {indices} do not tile output sizes {sizes}")
    starts = [0, *accumulate(sizes)]
    return {index: slice(starts[index], starts[index + 1]) for index in range(len(sizes))}


def _unfused(path: str, entries: list[tuple[int | None, str]]) -> str:
    """The one Hugging Face name of an unfused parameter."""
    if len(entries) != 1 or entries[0][0] is not None:
        raise UnsupportedModel(f"{path}: unexpected parts {[name for _, name in entries]}")
    return entries[0][1]


def _length(rows: slice) -> int:
    return rows.stop - rows.start


def _by_module(model: VLLMModule, names: Iterable[str]) -> dict[str, dict[str, list[tuple[int | None, str]]]]:
    """Checkpoint names grouped by the vLLM module that holds them: module path -> parameter ->
    [(index in a fused module, or None; checkpoint name)]."""
    fused_as = {
        part: (fused, index)
        for fused, parts in model.packed_modules_mapping.items()
        for index, part in enumerate(parts)
    }
    by_module: dict[str, dict[str, list[tuple[int | None, str]]]] = {}
    for name in sorted(names):
        path, _, param = name.rpartition(".")
        parent, _, leaf = path.rpartition(".")
        index = None
        if leaf in fused_as:
            fused, index = fused_as[leaf]
            path = f"{parent}.{fused}" if parent else fused
        by_module.setdefault(path, {}).setdefault(param, []).append((index, name))
    return by_module


def _repacks(model: VLLMModule, copies: list[_Copy], by_module: dict[str, Any]) -> list[str]:
    """Every embedding-method module whose weight is one we copy into repacks it afterwards: the
    embedding itself, an untied head, and a tied head (no tensor of its own, a shared weight)."""
    copied = {id(getattr(_submodule(model, c.module), c.param)) for c in copies}
    repacks: list[str] = []
    for path, module in model.named_modules():
        if not any(id(p) in copied for p in module.parameters(recurse=False)):
            continue
        if _is_embedding(module):
            repacks.append(path)
        elif path not in by_module:
            raise UnsupportedModel(f"{path} ({type(module).__name__}) shares a parameter we update")
    return repacks


def checkpoint_names(model_dir: Path) -> set[str]:
    """Tensor names stored in the model directory's safetensors files (headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


def record_names(
    weights: Iterable[tuple[str, torch.Tensor]], seen: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights`, each name added to `seen` as it passes (what an update sent, to check it whole)."""
    for name, tensor in weights:
        seen.add(name)
        yield name, tensor
