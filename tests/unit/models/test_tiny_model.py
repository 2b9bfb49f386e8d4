import torch

from rltrain.config.schema import ModelConfig
from rltrain.models.tiny import build_tiny_model_dir
from rltrain.models.tokenizer import build_char_tokenizer


def test_char_tokenizer_roundtrips_text():
    tok = build_char_tokenizer()
    text = "12+34=46\nHello, World!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_tiny_model_is_deterministic_and_cached(tiny_cache):
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    d1 = build_tiny_model_dir(cfg, seed=5)
    assert build_tiny_model_dir(cfg, seed=5) == d1
    d2 = build_tiny_model_dir(cfg, seed=6)
    assert d2 != d1
    m1 = AutoModelForCausalLM.from_pretrained(d1)
    assert m1.config.model_type == "qwen2"
    assert m1.config.hidden_size // m1.config.num_attention_heads == 32
    w1 = m1.model.embed_tokens.weight
    w2 = AutoModelForCausalLM.from_pretrained(d2).model.embed_tokens.weight
    assert not torch.equal(w1, w2)
