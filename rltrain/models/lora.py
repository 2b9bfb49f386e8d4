"""Low-rank adapters (peft LoRA) on a Hugging Face causal LM, ready for FSDP2.

Adapters are added in place (the model's linear layers become peft LoRA layers, the base frozen)
before sharding, and their initial values are drawn here from `trainer.seed`, not by peft, so one
rank and two ranks start bit for bit alike. Outside the trainer the adapters exist only merged
(weight sync, `final/merged/`) or as a PEFT adapter directory (`final/`). docs/lora.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rltrain.config.schema import LoraAdapterConfig
from rltrain.models.hf_io import fill_parameter
from rltrain.models.vision import VISION_MODULES_PATTERN, vision_modules

if TYPE_CHECKING:
    from peft import PeftModel

ALL_LINEAR = "all-linear"  # peft's name for every linear layer but the LM head
ADAPTER = "default"
MERGED_DIR = "merged"  # final/merged/: the merged model (model.lora.save_merged)  # the one adapter's name inside peft

Gather = Callable[[torch.Tensor], torch.Tensor]


def peft_config(settings: LoraAdapterConfig, exclude_modules: str | None = None) -> Any:
    """peft's LoraConfig; `exclude_modules`: a regex of module names left unadapted (a
    vision-language model's vision tower: LoRA adapts the language model)."""
    from peft import LoraConfig

    targets = list(settings.target_modules)
    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets,
        bias="none",
        task_type="CAUSAL_LM",
        exclude_modules=exclude_modules,
    )


def add_adapters(lm: torch.nn.Module, settings: LoraAdapterConfig) -> PeftModel:
    """Turn `lm`'s target linear layers into LoRA layers in place (the base frozen, adapters in the
    base's dtype) and return peft's wrapper, which owns saving and `disable_adapter`."""
    from peft import get_peft_model

    exclude = VISION_MODULES_PATTERN if vision_modules(lm) else None
    return get_peft_model(lm, peft_config(settings, exclude), autocast_adapter_dtype=False)


def source_name(name: str) -> str | None:
    """The base checkpoint's name of parameter `name` of an adapted model; None for an adapter's
    own parameters (the checkpoint has none: `fill_adapters` draws them)."""
    if ".lora_" in name:
        return None
    return name.replace(".base_layer.", ".")


def initial_adapters(lm: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Every adapter parameter's initial value in fp32 on the CPU, a pure function of the model's
    shapes and `seed`: A drawn as peft draws it (Kaiming-uniform, bound 1/sqrt(fan_in)), B zero,
    so the adapted model starts equal to the base."""
    generator = torch.Generator().manual_seed(seed)
    values = {}
    for name, param in lm.named_parameters():
        if ".lora_A." in name:
            bound = 1.0 / math.sqrt(param.shape[1])
            values[name] = (torch.rand(tuple(param.shape), generator=generator) * 2 - 1) * bound
        elif ".lora_B." in name:
            values[name] = torch.zeros(tuple(param.shape))
    return values


def fill_adapters(lm: torch.nn.Module, seed: int, group: Any = None, sharded: bool = False) -> None:
    """Set every adapter parameter to `initial_adapters`; `sharded`: rank 0 draws and scatters
    each rank its rows (collective over `group`)."""
    import torch.distributed as dist

    initial = initial_adapters(lm, seed) if not sharded or dist.get_rank() == 0 else {}
    with torch.no_grad():
        for name, param in lm.named_parameters():
            if ".lora_" not in name:
                continue
            value = initial[name].to(param.device, param.dtype) if initial else None
            if sharded:
                fill_parameter(param, value, group)
            else:
                assert value is not None
                param.copy_(value)


def merged_weights(lm: torch.nn.Module, gather: Gather, with_adapters: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under the base's Hugging Face names, each adapted weight merged
    (W + scale * B @ A, computed in fp32). Collective when `gather` is (every rank, same order).
    `with_adapters=False` yields the base alone (the `adapter_dropped` fault)."""
    from peft.tuners.lora import Linear as LoraLinear

    adapted = {f"{name}.base_layer.weight": m for name, m in lm.named_modules() if isinstance(m, LoraLinear)}
    for name, tensor in lm.state_dict().items():
        if ".lora_" in name:
            continue
        full = gather(tensor).detach()
        module = adapted.get(name)
        if module is not None:
            a_RI = gather(_weight(module.lora_A[ADAPTER]).detach())
            b_OR = gather(_weight(module.lora_B[ADAPTER]).detach())
            if with_adapters:
                delta_OI = (b_OR.float() @ a_RI.float()) * module.scaling[ADAPTER]
                full = (full.float() + delta_OI).to(full.dtype)
        yield name.replace(".base_layer.", "."), full


def _weight(linear: Any) -> torch.Tensor:
    return linear.weight


def adapter_state(lm: torch.nn.Module, gather: Gather) -> dict[str, torch.Tensor]:
    """Every adapter parameter, full, under peft's names (collective when `gather` is)."""
    return {name: gather(p.detach()) for name, p in lm.named_parameters() if ".lora_" in name}


def save_adapter_dir(adapters: PeftModel, directory: Path, state: dict[str, torch.Tensor], base_dir: Path) -> None:
    """`directory` as a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)
    that `PeftModel.from_pretrained(base, directory)` loads onto the model at `base_dir`."""
    adapters.peft_config[ADAPTER].base_model_name_or_path = str(base_dir)
    prefixed = {f"base_model.model.{name}": tensor.contiguous() for name, tensor in state.items()}
    adapters.save_pretrained(str(directory), state_dict=prefixed, safe_serialization=True)
    if not (directory / "adapter_model.safetensors").is_file():
        raise RuntimeError(f"peft wrote no adapter_model.safetensors into {directory}")
    # peft writes target_modules in a set's order, which changes from process to process: sorted,
    # the same run writes the same bytes.
    config_path = directory / "adapter_config.json"
    config = json.loads(config_path.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def is_adapter_dir(directory: Path) -> bool:
    """True for a PEFT adapter directory (what `final/` of a LoRA run is)."""
    path = directory / "adapter_config.json"
    return path.is_file() and "peft_type" in json.loads(path.read_text())
