"""Parity on images for the rollout tests (issue 63): rows with one, two and no images on the tiny
vision-language model (`model=tiny_vl`, the session's `tiny_vl_dir` fixture), and the forward a
trainer must run to score an engine's samples (each row with its own images, the placeholders of
its prompt only)."""

from __future__ import annotations

from pathlib import Path

import torch


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
