"""A tiny reward model of our own: the tiny architecture with a one-output score head.

`reward_model=hf` needs a Hugging Face sequence classifier on disk, and nothing can be downloaded
here, so this builds one locally from the same architecture description and character tokenizer as
the embedded policy (rltrain/models/tiny.py): `Qwen2ForSequenceClassification` (or Llama's) with
`num_labels=1`, random but deterministic from the seed, saved with `save_pretrained` beside its
tokenizer. Its scores carry no knowledge; it exists to exercise the reward-model path end to end:

    python -m rltrain.models.tiny_reward /tmp/tiny-rm
    python -m rltrain reward_model=hf reward_model.path=/tmp/tiny-rm
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from rltrain.config.schema import ModelConfig
from rltrain.models.tiny import hf_config_for
from rltrain.models.tokenizer import build_char_tokenizer, padded_vocab_size


def build_tiny_reward_model_dir(target: Path, seed: int = 0, cfg: ModelConfig | None = None) -> Path:
    """Write the tiny sequence classifier for `cfg` (the tiny model's defaults when None) and `seed`
    to `target` (written to a temporary sibling and renamed into place); return `target`."""
    from transformers import AutoModelForSequenceClassification

    target = Path(target)
    tokenizer = build_char_tokenizer()
    hf_config = hf_config_for(
        cfg or ModelConfig(),
        vocab_size=padded_vocab_size(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    hf_config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(hf_config, dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random reward model (for reward_model.path).")
    parser.add_argument("target", type=Path, help="directory to create (must not exist)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.target.exists():
        parser.error(f"{args.target} already exists; give a new directory")
    print(build_tiny_reward_model_dir(args.target, args.seed))


if __name__ == "__main__":
    main()
