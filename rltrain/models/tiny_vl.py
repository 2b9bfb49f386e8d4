"""The embedded vision-language model (model=tiny_vl): a tiny Qwen2-VL built locally, deterministic
from the seed, with the character tokenizer plus Qwen2-VL's vision tokens and a small-image processor.

Saved as a normal Hugging Face directory (config, safetensors, tokenizer, processor) that
`AutoModelForImageTextToText` and `AutoProcessor` load, cached by shape and seed like model=tiny.
Text head size 32 because vLLM's CPU attention refuses smaller heads. docs/vision.md.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from rltrain.config.schema import ModelConfig
from rltrain.models.tiny import DEFAULT_CACHE, publish_directory
from rltrain.models.tokenizer import build_char_tokenizer, padded_vocab_size
from rltrain.runtime.torchvision_compat import ensure_torchvision

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
IMAGE_MARKUP = VISION_START + IMAGE_PAD + VISION_END  # what one image part renders as

# The character template, with content parts: text as it is, an image as its markup (the processor
# then repeats IMAGE_PAD once per visual token).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] | upper }}:"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] in ('image', 'image_url') %}" + IMAGE_MARKUP + "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)

# The vision tower and the images it sees: 14-pixel patches merged 2x2 into one visual token, so a
# 28x28 image is one token and a 56x56 image four; images are resized into [MIN_PIXELS, MAX_PIXELS].
VISION = dict(depth=2, embed_dim=64, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
MIN_PIXELS = 28 * 28
MAX_PIXELS = 112 * 112
FORMAT = 2  # bumped when the files change (2: the template keeps each message's newline)


def build_vl_tokenizer():
    """The character tokenizer with the vision tokens appended (ids after the characters)."""
    from tokenizers import AddedToken

    tokenizer = build_char_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_processor(tokenizer) -> Any:
    """Qwen2-VL's processor around `tokenizer`, sized for tiny images."""
    ensure_torchvision()
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    sizes: dict[str, Any] = dict(
        patch_size=VISION["patch_size"],
        merge_size=VISION["spatial_merge_size"],
        temporal_patch_size=VISION["temporal_patch_size"],
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**sizes),
        video_processor=Qwen2VLVideoProcessor(**sizes),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )


def tiny_vl_config(tokenizer, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 2, num_kv_heads: int = 1,
                   intermediate_size: int = 128, max_position_embeddings: int = 1024):
    """The transformers config: Qwen2-VL text decoder of the given shape, the tiny vision tower above."""
    from transformers import Qwen2VLConfig

    if hidden_size % num_heads:
        raise ValueError(f"model.hidden_size={hidden_size} is not divisible by model.num_heads={num_heads}")
    head_dim = hidden_size // num_heads
    quarter = head_dim // 4  # M-RoPE splits head_dim/2 rotary pairs among time, height and width
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(
        vocab_size=padded_vocab_size(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [head_dim // 2 - 2 * quarter, quarter, quarter]},
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    return Qwen2VLConfig(
        text_config=text, vision_config=dict(VISION, hidden_size=hidden_size, in_channels=3),
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, torch_dtype="float32",
    )


def write_tiny_vl_dir(directory: Path, seed: int, **shape: int) -> None:
    """Write the model, tokenizer and processor into `directory` (which exists)."""
    from transformers import Qwen2VLForConditionalGeneration

    tokenizer = build_vl_tokenizer()
    config = tiny_vl_config(tokenizer, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration._from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    build_processor(tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def shape_of(cfg: ModelConfig) -> dict[str, int]:
    return dict(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                num_kv_heads=cfg.num_kv_heads, intermediate_size=cfg.intermediate_size,
                max_position_embeddings=cfg.max_position_embeddings)


def build_tiny_vl_model_dir(cfg: ModelConfig, seed: int) -> Path:
    """Build (once) and return the directory of the tiny vision-language model for `cfg` and `seed`;
    written to a temporary sibling and renamed into place, like model=tiny."""
    shape = shape_of(cfg)
    key = hashlib.sha256(json.dumps(dict(shape, seed=seed, vision=VISION, format=FORMAT), sort_keys=True).encode())
    cache = Path(cfg.cache_dir) if cfg.cache_dir else DEFAULT_CACHE / "models"
    target = cache / f"tiny-qwen2_vl-{key.hexdigest()[:16]}"
    if (target / "config.json").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=cache))
    try:
        write_tiny_vl_dir(tmp, seed, **shape)
        publish_directory(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
