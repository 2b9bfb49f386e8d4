"""Tokenizer directories load as their files describe them (rltrain.models.tokenizer.load_tokenizer)."""

from __future__ import annotations

from rltrain.config.schema import ModelConfig
from rltrain.models.tiny import build_tiny_model_dir
from rltrain.models.tokenizer import build_char_tokenizer, load_tokenizer

TEXT = "U:what is 12 + 34?\nA: 46\n"


def test_the_tiny_model_directory_keeps_spaces_and_newlines(tmp_path):
    """The built-in tiny model is a qwen2 config next to a character tokenizer: read back through
    the directory it must tokenize exactly as the tokenizer it was built from (transformers 5's
    AutoTokenizer turns it into a Qwen2Tokenizer that drops whitespace)."""
    built = build_char_tokenizer()
    for arch in ("qwen2", "llama"):
        model_dir = build_tiny_model_dir(ModelConfig(arch=arch, cache_dir=str(tmp_path)), seed=0)
        loaded = load_tokenizer(model_dir)
        ids = loaded(TEXT, add_special_tokens=False)["input_ids"]
        assert ids == built(TEXT, add_special_tokens=False)["input_ids"], arch
        assert loaded.decode(ids) == TEXT
        assert (loaded.eos_token_id, loaded.pad_token_id) == (built.eos_token_id, built.pad_token_id)
        chat = [{"role": "user", "content": "1 + 2"}, {"role": "assistant", "content": "3"}]
        assert loaded.apply_chat_template(chat, tokenize=False) == "U:1 + 2\nA:3\n"


def test_a_directory_with_its_own_tokenizer_class_goes_through_auto_tokenizer(tmp_path):
    from transformers import GPT2TokenizerFast

    GPT2TokenizerFast(tokenizer_object=build_char_tokenizer().backend_tokenizer).save_pretrained(tmp_path)
    assert type(load_tokenizer(tmp_path)).__name__ == "GPT2Tokenizer"
