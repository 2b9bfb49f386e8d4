"""A character-level tokenizer built locally, saved as a normal Hugging Face tokenizer directory.

Every printable ASCII character (plus newline) is one token, so arithmetic and other synthetic
tasks tokenize exactly and any text round-trips. The result is a `PreTrainedTokenizerFast` saved as a
plain `tokenizer.json`; rltrain reads every tokenizer directory with `load_tokenizer` (below).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

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


# tokenizer_config.json class names that mean "tokenizer.json is the whole tokenizer".
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(directory: str | Path):
    """The tokenizer a model directory describes, as its files describe it.

    Why not `AutoTokenizer` alone: transformers 5 replaces a generic fast tokenizer with the class
    registered for the config's model type when that type is on its list of hub models with a wrong
    `tokenizer_class` (qwen2 is): the character tokenizer of the built-in tiny model then loads as a
    `Qwen2Tokenizer`, whose byte-level pre-tokenizer silently drops spaces and newlines (chat
    templates and any text with whitespace lose characters). A directory whose tokenizer_config.json
    names the generic class is read as exactly that, its tokenizer.json, as transformers 4 did;
    every other directory (a hub model's own tokenizer class) goes through `AutoTokenizer`.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = Path(directory) / "tokenizer_config.json"
    try:
        declared = json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        declared = None
    if declared in GENERIC_TOKENIZER_CLASSES and (Path(directory) / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    return AutoTokenizer.from_pretrained(str(directory))


def with_chat_template_kwargs(tokenizer, kwargs: dict[str, Any]):
    """`tokenizer`, every `apply_chat_template` of which gets `kwargs` (`data.chat_template_kwargs`,
    e.g. enable_thinking=False): the run's data, environments and agents' endpoint all render
    through it, so none can miss them. A call's own arguments win."""
    if kwargs:
        tokenizer.apply_chat_template = functools.partial(tokenizer.apply_chat_template, **dict(kwargs.items()))
    return tokenizer

