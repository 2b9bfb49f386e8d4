"""model=tiny_vl: a Qwen2-VL directory that transformers' Auto classes load, deterministic from the
seed, whose processor turns one image part into as many visual tokens as the image's grid asks."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from rltrain.config.schema import ModelConfig
from rltrain.models.tiny_vl import IMAGE_PAD, build_tiny_vl_model_dir
from rltrain.runtime.torchvision_compat import ensure_torchvision


def test_the_directory_loads_with_the_auto_classes_and_sees_the_image(tiny_vl_dir):
    ensure_torchvision()
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir)
    processor = AutoProcessor.from_pretrained(tiny_vl_dir)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert model.config.text_config.hidden_size // model.config.text_config.num_attention_heads == 32
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour? "}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch = [processor(text=[text], images=[Image.new("RGB", (56, 56), colour)], return_tensors="pt")
             for colour in ((255, 0, 0), (0, 0, 255))]
    assert batch[0]["image_grid_thw"].tolist() == [[1, 4, 4]]  # 56 px = 4 patches a side, merged 2x2
    assert (batch[0]["input_ids"] == processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)).sum() == 4
    assert processor.tokenizer.decode(batch[0]["input_ids"][0]).endswith("Which colour? \nA:")
    with torch.no_grad():
        logits = [model(**b).logits[0, -1] for b in batch]
    assert not torch.allclose(logits[0], logits[1])  # the image reaches the output


def test_the_build_is_deterministic_from_the_seed(tiny_vl_dir, tmp_path):
    shape = dict(arch="qwen2_vl", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                 intermediate_size=128, max_position_embeddings=1024)
    assert build_tiny_vl_model_dir(ModelConfig(**shape), seed=0) == tiny_vl_dir  # cached
    again = load_file(build_tiny_vl_model_dir(ModelConfig(**shape, cache_dir=str(tmp_path)), seed=0) / "model.safetensors")
    other = load_file(build_tiny_vl_model_dir(ModelConfig(**shape, cache_dir=str(tmp_path)), seed=1) / "model.safetensors")
    first = load_file(tiny_vl_dir / "model.safetensors")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first)


def test_megatron_refuses_a_vision_language_model_in_one_paragraph(tiny_vl_dir):
    from rltrain.models.vision import refuse_on_megatron
    from rltrain.runtime.errors import UserError

    with pytest.raises(UserError, match="backend=megatron does not train vision-language models") as err:
        refuse_on_megatron(tiny_vl_dir)
    assert "backend=fsdp" in str(err.value) and "\n" not in str(err.value)

