"""SFT rows with images: each row's prompt ids (visual tokens included) and images, the completion
text tokenized as for text rows, `data.overlong` applied to the whole (visual tokens count); the
held-out rows as prompts with images and the completion greedy decoding must reproduce."""

from __future__ import annotations

from rltrain.config.schema import DataConfig
from rltrain.data.tokenize import OverlongStats, TokenizedPair, encode_all, fit_length
from rltrain.data.vision_inputs import VisionInputs
from rltrain.data.vision_rows import RowSource, vision_encoder, vision_prompt_completion
from rltrain.runtime.errors import UserError


def vision_sft_pairs(
    processor, rows: list[dict], source: RowSource, data_cfg: DataConfig
) -> tuple[list[TokenizedPair], OverlongStats]:
    """(training pairs with their images, overlong counts); `processor` None: a text-only model."""
    encoder = vision_encoder(processor, source)
    tokenizer = processor.tokenizer
    encoded = [vision_prompt_completion(encoder, row, i, source) for i, row in enumerate(rows)]
    completions = encode_all(tokenizer, [completion for _, completion, _ in encoded])
    stats = OverlongStats()
    train: list[TokenizedPair] = []
    for (prompt_ids, _, vision), completion_ids in zip(encoded, completions, strict=True):
        pair = fit_length(prompt_ids, completion_ids + [tokenizer.eos_token_id], data_cfg.max_length, data_cfg.overlong, stats, source.where)
        if pair is not None:
            pair.vision = vision
            train.append(pair)
    if not train:
        raise UserError(f"{source.where}: no training rows are left (all were dropped as longer than data.max_length).")
    return train, stats


def vision_eval_items(processor, rows: list[dict], source: RowSource) -> list[tuple[list[int], str, VisionInputs | None]]:
    """(prompt ids, reference completion, images) of held-out rows."""
    if not rows:
        return []
    encoder = vision_encoder(processor, source)
    return [vision_prompt_completion(encoder, row, i, source) for i, row in enumerate(rows)]
