"""A tiny Qwen2-VL for the rollout tests with images (issue 63), built once per test session.

It mirrors `model=tiny_vl` (the character tokenizer plus Qwen2-VL's vision tokens, a 64-wide text
decoder with head size 32, a two-block vision tower, tied embeddings, images resized into
[28*28, 112*112] pixels) with the PIL image processor, so that building it needs no torchvision.
Once `model=tiny_vl` is on this branch, its builder (`tiny_vl_dir`) replaces this one.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def write_tiny_qwen2_vl(directory: Path, seed: int = 0) -> None:
    from tokenizers import AddedToken
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rltrain.models.tokenizer import build_char_tokenizer, padded_vocab_size

    tokenizer = build_char_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS], special_tokens=True)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    special = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    text = dict(
        vocab_size=padded_vocab_size(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 4, 4]}, **special,
    )
    vision = dict(depth=2, embed_dim=64, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, hidden_size=64, in_channels=3)
    config = Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, torch_dtype="float32", **special,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration._from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil(size={"shortest_edge": 28 * 28, "longest_edge": 112 * 112}).save_pretrained(directory)


def tiny_qwen2_vl_dir(cache: Path) -> Path:
    """The model's directory under `cache`, built there once (renamed into place whole)."""
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / "tiny-qwen2-vl"
    if not (target / "config.json").exists():
        tmp = Path(tempfile.mkdtemp(prefix="build-", dir=cache))
        try:
            write_tiny_qwen2_vl(tmp)
            try:
                tmp.rename(target)
            except OSError:  # another test process published it first
                if not (target / "config.json").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def picture(seed: int, height: int, width: int):
    """A random RGB image (its pixels drawn from `seed`)."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def image_inputs(image_processor, images) -> dict[str, torch.Tensor]:
    """The processor's `pixel_values` and `image_grid_thw` of `images` (what vLLM computes too)."""
    return dict(image_processor(images=list(images), return_tensors="pt"))


def expand(ids: list[int], images, image_processor, pad_id: int) -> list[int]:
    """`ids` (one `pad_id` per image) with each placeholder repeated once per visual token, as the
    model's processor writes a prompt."""
    grids = image_inputs(image_processor, images)["image_grid_thw"] if images else []
    per_image = iter(int(g.prod()) // image_processor.merge_size**2 for g in grids)
    out: list[int] = []
    for tok in ids:
        out += [tok] * next(per_image) if tok == pad_id else [tok]
    return out


def trainer_logits(model, image_processor, ids_T: torch.Tensor, prompt_len: int, pad_id: int, images) -> torch.Tensor:
    """[T, V] logits of a Qwen2-VL forward the way a trainer must run it: the image positions are
    the prompt's placeholders only (`mm_token_type_ids`), so a completion that samples the
    placeholder token keeps it as text, as vLLM does; transformers' own forward counts every
    placeholder token in `input_ids` and refuses such a row."""
    inner = model.model
    ids_BT = ids_T[None]
    mm_BT = torch.zeros_like(ids_BT)
    mm_BT[0, :prompt_len] = (ids_T[:prompt_len] == pad_id).long()
    embeds_BTH = inner.get_input_embeddings()(ids_BT)
    grid = None
    if images:
        pixels = image_inputs(image_processor, images)
        grid = pixels["image_grid_thw"]
        features = torch.cat(inner.get_image_features(pixels["pixel_values"], grid).pooler_output)
        embeds_BTH = embeds_BTH.masked_scatter(mm_BT.bool()[..., None].expand_as(embeds_BTH), features)
    position_ids, _ = inner.get_rope_index(ids_BT, mm_BT, image_grid_thw=grid)
    return model(inputs_embeds=embeds_BTH, position_ids=position_ids).logits[0].float()


def max_logprob_diff(model, image_processor, prompts, images, completions, pad_id: int) -> float:
    """Largest |engine logprob - the trainer-style forward's temperature-1 log-softmax| over every
    sampled token, each row forwarded with its own images."""
    worst = 0.0
    with torch.no_grad():
        for c in completions:
            prompt = c.prompt_ids if c.prompt_ids is not None else prompts[c.prompt_index]
            ids_T = torch.tensor([*prompt, *c.token_ids])
            row_images = images[c.prompt_index] if images else None
            logits_TV = trainer_logits(model, image_processor, ids_T, len(prompt), pad_id, row_images)
            ref_N = torch.log_softmax(logits_TV, -1)[len(prompt) - 1 : -1].gather(-1, ids_T[len(prompt) :, None])[:, 0]
            worst = max(worst, float((ref_N - torch.tensor(c.logprobs)).abs().max()))
    return worst


def vision_rows(model_dir: Path):
    """(prompts, images, image processor, placeholder id) the rollout tests share: one image, two
    images of different sizes, a text-only row (these three expanded as the processor writes them),
    and a row with one placeholder for its image."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    start, pad, end = (tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
    image = [start, pad, end]
    raw = [tok.encode("U:what is it?") + image + tok.encode("\nA:"), tok.encode("U:") + image + image + tok.encode("same?\nA:"),
           tok.encode("U:hello\nA:"), tok.encode("U:and this") + image + tok.encode("?\nA:")]
    images = [[picture(0, 56, 84)], [picture(1, 28, 28), picture(2, 112, 56)], [], [picture(3, 84, 84)]]
    prompts = [expand(p, im, processor, pad) for p, im in zip(raw[:3], images[:3], strict=True)] + [raw[3]]
    return prompts, images, processor, pad


def vision_tower_update(model, seed: int, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Every parameter, the vision tower's (`visual.`) plus Gaussian noise; loaded into `model`."""
    g = torch.Generator().manual_seed(seed)
    state = {
        n: p.detach() + (scale * torch.randn(p.shape, generator=g) if ".visual." in f".{n}" else 0)
        for n, p in model.named_parameters()
    }
    assert sum(".visual." in f".{n}" for n in state) > 10
    model.load_state_dict(state, strict=False)
    return state


def logprobs_of(completions, row: int) -> list[list[float]]:
    """The log-probabilities of prompt `row`'s completions."""
    return [c.logprobs for c in completions if c.prompt_index == row]
