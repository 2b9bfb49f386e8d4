"""A character-level tokenizer built locally, saved as a normal Hugging Face tokenizer directory.

Every printable ASCII character (plus newline) is one token, so arithmetic and other synthetic
tasks tokenize exactly and any text round-trips. The result is a `PreTrainedTokenizerFast`: it
loads with `AutoTokenizer.from_pretrained` and in vLLM like any hub tokenizer.
"""

from __future__ import annotations

from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
CHARACTERS = ["\n"] + [chr(c) for c in range(32, 127)]

# Renders `messages` (TRL's conversational form) as plain text; the model learns the markers.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)


def build_char_tokenizer(vocab_pad_to: int = 128):
    """Return a `PreTrainedTokenizerFast` whose ids are stable: specials first, then characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(vocab) <= vocab_pad_to
    return tokenizer


def padded_vocab_size(tokenizer, multiple: int = 64) -> int:
    """Embedding rows: the vocabulary rounded up so tensor-parallel splits stay even."""
    n = len(tokenizer)
    return (n + multiple - 1) // multiple * multiple


def save_tokenizer(tokenizer, directory: str | Path) -> None:
    tokenizer.save_pretrained(str(directory))
