"""Vision-language models in the trainer: recognising one, loading it, where its parts live.

A directory whose config has a `vision_config` loads with `AutoModelForImageTextToText` (Qwen2-VL,
Qwen2.5-VL, LLaVA, ...); every other directory keeps the causal-LM path. The language model's
decoder layers are what FSDP wraps and LoRA adapts; the vision tower (and its projector) is frozen
unless `model.freeze_vision=false`. docs/vision.md.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rltrain.runtime.errors import UserError
from rltrain.runtime.torchvision_compat import ensure_torchvision

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Submodules of `lm.model` that see pixels, by architecture: Qwen2-VL's `visual`, LLaVA's tower and
# projector, Idefics3's vision model and connector.
VISION_MODULE_NAMES = ("visual", "vision_tower", "multi_modal_projector", "vision_model", "connector")
# A regex peft matches against module names: what LoRA must leave alone in a vision-language model.
VISION_MODULES_PATTERN = r".*\.(" + "|".join(VISION_MODULE_NAMES) + r")\..*"
PROBE_VALUES = 16  # values of an image's first, middle and last patch that bucket repeated images


def is_vision_config(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def is_vision_model_dir(model_dir: Path) -> bool:
    """Whether `model_dir` holds a vision-language model (its config.json has a vision_config)."""
    try:
        return "vision_config" in json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def load_vision_lm(model_dir: Path, dtype: torch.dtype, on_meta: bool = False) -> PreTrainedModel:
    """`load_causal_lm`'s twin for vision-language models (same arguments, same attention)."""
    ensure_torchvision()
    from transformers import AutoConfig, AutoModelForImageTextToText

    if on_meta:
        config = AutoConfig.from_pretrained(str(model_dir))
        with torch.device("meta"):
            return AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa")


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The language model's decoder layers: `lm.model.layers`, or inside a vision-language model
    `lm.model.language_model.layers`."""
    body = lm.model
    assert isinstance(body, nn.Module)
    inner = body.language_model if hasattr(body, "language_model") else body
    assert isinstance(inner, nn.Module)
    layers = inner.layers
    assert isinstance(layers, nn.ModuleList)
    return layers


def vision_modules(lm: nn.Module) -> list[nn.Module]:
    """The submodules that see pixels (none in a text-only model)."""
    body = lm.model
    assert isinstance(body, nn.Module)
    return [m for name in VISION_MODULE_NAMES if isinstance(m := getattr(body, name, None), nn.Module)]


def freeze_vision(lm: nn.Module) -> int:
    """Freeze the vision tower and projector; returns how many parameters that froze."""
    frozen = 0
    for module in vision_modules(lm):
        for param in module.parameters():
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index")


def image_token_id(config: Any) -> int | None:
    """The token id that stands for one visual token in the prompt, of a transformers config or
    config.json's dict (Qwen2-VL: `image_token_id`, LLaVA and Gemma 3: `image_token_index`); None
    for a text-only model. The trainer and every rollout engine read it here."""
    for key in IMAGE_TOKEN_KEYS:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def grid_model_inputs(inner: PreTrainedModel, input_ids_BT: torch.Tensor, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The language model's call inputs for a Qwen2-VL-family model (image grids): the token
    embeddings with each image's features placed where `mm_token_type_ids` marks the placeholders
    the policy did not sample (the prompts' and observations'), and the M-RoPE positions those
    marks give. Transformers' own forward would take every placeholder token in `input_ids` as an
    image slot, so a completion that sampled the placeholder (the rollout engine takes it as text)
    would not match its image features."""
    grid_I3 = inputs["image_grid_thw"]
    marks_BT = inputs["mm_token_type_ids"]
    embeds_BTH = inner.get_input_embeddings()(input_ids_BT)
    # The tower sees each distinct image once: a group's completions (a pair's two sides) carry the
    # same prompt images, and the features are then shared, gradients included (docs/vision.md).
    pixels_PC, grid_U3, source_I = distinct_images(inputs["pixel_values"], grid_I3)
    output = inner.get_image_features(pixels_PC, grid_U3).pooler_output
    if isinstance(output, torch.Tensor):  # one tensor over every image's visual tokens: split per image
        merge = int(inner.config.vision_config.spatial_merge_size)
        output = torch.split(output, (grid_U3.prod(-1) // merge**2).tolist())
    features_U = list(output)  # each distinct image's [tokens, H]
    features_NH = torch.cat([features_U[i] for i in source_I])
    slots_BTH = marks_BT.bool()[..., None].expand_as(embeds_BTH)
    embeds_BTH = embeds_BTH.masked_scatter(slots_BTH, features_NH.to(embeds_BTH.dtype))
    return {"inputs_embeds": embeds_BTH, "position_ids": grid_positions(inner, marks_BT, grid_I3)}


def grid_positions(inner: PreTrainedModel, marks_BT: torch.Tensor, grid_I3: torch.Tensor) -> torch.Tensor:
    """M-RoPE positions [3, B, T], as the model's `get_rope_index` gives them, computed once per
    distinct layout of images: a row's positions depend only on where its images sit and on their
    grids, and after its last image they rise by one per token. A group's completions share their
    prompt's layout, so the per-row Python of `get_rope_index` runs once per prompt."""
    rows, width = marks_BT.shape
    marked_BT = marks_BT.bool().cpu()
    images_B = (marked_BT & ~torch.nn.functional.pad(marked_BT[:, :-1], (1, 0))).sum(1).tolist()  # runs = images
    last_B = torch.where(marked_BT.any(1), width - 1 - marked_BT.flip(1).int().argmax(1), -1).tolist()
    grids = torch.split(grid_I3, images_B)
    layouts: dict[tuple, int] = {}
    kept: list[int] = []  # the first row of each distinct layout
    layout_B: list[int] = []  # each row's layout, -1 for a row without images
    for row, last in enumerate(last_B):
        if last < 0:
            layout_B.append(-1)
            continue
        key = (marked_BT[row, : last + 1].numpy().tobytes(), tuple(grids[row].flatten().tolist()))
        if key not in layouts:
            layouts[key] = len(kept)
            kept.append(row)
        layout_B.append(layouts[key])
    out_3BT = torch.arange(width, device=marks_BT.device).expand(3, rows, width).clone()
    if not kept:
        return out_3BT
    # Each layout up to one token past its last image: that token's position starts the text run.
    span = min(width, max(last_B[r] for r in kept) + 2)
    marks_UL = marks_BT[kept, :span]
    grid_U3 = torch.cat([grids[r] for r in kept])
    positions_3UL = inner.get_rope_index(torch.zeros_like(marks_UL, dtype=torch.long), marks_UL, image_grid_thw=grid_U3)[0]
    for row, (last, u) in enumerate(zip(last_B, layout_B)):
        if u < 0:
            continue
        out_3BT[:, row, : last + 1] = positions_3UL[:, u, : last + 1]
        if last + 1 < width:
            out_3BT[:, row, last + 1 :] += positions_3UL[0, u, last + 1] - (last + 1)
    return out_3BT


def distinct_images(
    pixel_values_PC: torch.Tensor, grid_I3: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(the distinct images' patches, their grids, for each image the index of its distinct image).
    Images come as consecutive runs of patches (`grid.prod()` rows each, Qwen2-VL's layout); two are
    the same when their grids and patches are exactly equal. A few values of each image's first,
    middle and last patch bucket the candidates, so only likely duplicates are compared in full."""
    sizes_I = grid_I3.prod(-1)
    ends_I = sizes_I.cumsum(0)
    probes_3I = torch.stack([ends_I - sizes_I, ends_I - (sizes_I + 1) // 2, ends_I - 1])
    keys = pixel_values_PC[probes_3I.T.reshape(-1), :PROBE_VALUES].reshape(len(sizes_I), -1)
    images = torch.split(pixel_values_PC, sizes_I.tolist())
    buckets: dict[tuple, list[int]] = {}
    kept: list[int] = []  # image index of each distinct image
    source: list[int] = []
    for i, key in enumerate(zip(grid_I3.tolist(), keys.tolist())):
        bucket = buckets.setdefault((*key[0], *key[1]), [])
        same = next((d for d in bucket if torch.equal(images[kept[d]], images[i])), None)
        if same is None:
            same = len(kept)
            kept.append(i)
            bucket.append(same)
        source.append(same)
    if len(kept) == len(sizes_I):
        return pixel_values_PC, grid_I3, source
    return torch.cat([images[i] for i in kept]), grid_I3[kept], source


def places_by_grid(inputs: dict[str, torch.Tensor]) -> bool:
    """Whether a call's image inputs are placed by `grid_model_inputs` (pixels with image grids)."""
    return "pixel_values" in inputs and "image_grid_thw" in inputs and "mm_token_type_ids" in inputs


def load_processor(model_dir: Path, tokenizer):
    """A vision-language model's processor around the run's `tokenizer` (the one every text path
    uses); None for a text-only model."""
    if not is_vision_model_dir(model_dir):
        return None
    ensure_torchvision()
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(model_dir), tokenizer=tokenizer)


# A processor's own files (transformers writes one or several, by version and model).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")


def copy_processor_files(model_dir: Path, directory: Path) -> None:
    """Copy the processor files of the model a run started from into an output directory, so that
    `final/` loads with AutoProcessor as the start did (nothing for a text-only model)."""
    for name in PROCESSOR_FILES:
        if (Path(model_dir) / name).is_file():
            shutil.copyfile(Path(model_dir) / name, Path(directory) / name)


def refuse_on_megatron(model_dir: Path) -> None:
    """backend=megatron trains text-only models: a vision-language model is refused in one paragraph."""
    if is_vision_model_dir(model_dir):
        raise UserError(
            f"backend=megatron does not train vision-language models ({model_dir} has a vision tower): rltrain "
            "converts only text decoders to megatron-core. Use backend=fsdp, which trains them on 1 or more "
            "ranks, with or without LoRA (docs/vision.md)."
        )


def vision_auto_class():
    """AutoModelForImageTextToText, torchvision made importable first."""
    ensure_torchvision()
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText
