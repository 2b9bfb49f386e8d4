"""A reward model (algo=rm) of a vision-language model on the FSDP engine, exported and scored.

After one Bradley-Terry step on pairs with images (one image, two of different sizes, none, and one
prompt text under two images), `save_pretrained` writes the model directory plus `score.safetensors`;
loaded as `reward_model=hf` loads it (`VisionSequenceReward`: AutoModelForImageTextToText and
AutoProcessor), it must give every completion, read with its prompt's images, the reward the engine
gave it (1e-5). Layouts: 1 rank, and 2 ranks with LoRA (the adapters merged into the language model,
which must differ from the base where they trained). The ranks of a run agree with each other.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_ranks
from test_reward_model_export import step_score_and_export

pytestmark = pytest.mark.dist

SEED = 5
COLOURS = [(220, 20, 20), (20, 20, 220), (20, 200, 20), (200, 200, 20)]
SIZES = [(56, 56), (28, 28), (56, 28), (28, 56)]


def _texts(model_dir):
    """(prompt text in the model's markup, chosen, rejected, images) of five pairs: rows 0 and 1
    share their prompt text and differ in the image, row 2 has two images, row 4 none."""
    from PIL import Image

    from rltrain.data.vision_rows import RowSource, VisionEncoder
    from rltrain.models.tokenizer import load_tokenizer
    from rltrain.models.vision import load_processor

    encoder = VisionEncoder(load_processor(model_dir, load_tokenizer(model_dir)))
    source = RowSource("test rows", model_dir)
    out = []
    for i in range(5):
        images = [Image.new("RGB", SIZES[(i + j) % 4], COLOURS[(i + j) % 4]) for j in range(2 if i == 2 else 1)] if i != 4 else []
        prompt = encoder.text_prompt("<image>" * len(images) + ("Colour? " if i < 2 else f"Row {i}: colour? "), images, i, source)
        out.append((prompt, ["red", "blue", "green", "yellow", "grey"][i], ["blue", "green", "red", "grey", "pink"][i], images))
    return out


def _pairs(model_dir):
    from rltrain.data.preference_data import PreferencePair
    from rltrain.data.vision_rows import VisionEncoder
    from rltrain.models.tokenizer import load_tokenizer
    from rltrain.models.vision import load_processor

    tokenizer = load_tokenizer(model_dir)
    encoder = VisionEncoder(load_processor(model_dir, tokenizer))

    def completion(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    pairs = []
    for i, (prompt, chosen, rejected, images) in enumerate(_texts(model_dir)):
        ids, vision = encoder.encode(prompt, images)
        pairs.append(PreferencePair(ids, completion(chosen), completion(rejected), 0.5 * (i % 2), vision))
    return pairs


def _train_and_export(rank, world, model_dir, out_dir, lora):
    from rltrain.backends.fsdp.engine import FSDPEngine
    from rltrain.config.group_options import FSDPBackendConfig
    from rltrain.config.schema import LoraAdapterConfig, OptimConfig

    torch.set_num_threads(1)
    pairs = _pairs(model_dir)
    adapters = LoraAdapterConfig(rank=8, alpha=16) if lora else None
    engine = FSDPEngine(model_dir, FSDPBackendConfig(), OptimConfig(lr=1e-2, warmup_steps=0), 10, torch.device("cpu"),
                        value_head_seed=SEED, value_head_bias=False, adapters=adapters, seed=SEED)
    return step_score_and_export(engine, pairs, out_dir)


@pytest.mark.parametrize("nproc, lora", [(1, False), (2, True)], ids=["fsdp-1", "fsdp-lora-2"])
def test_exported_vision_reward_model_scores_as_the_engine(tiny_vl_dir, tmp_path, nproc, lora):
    from safetensors.torch import load_file

    from rltrain.backends.sequence_classifier import REWARD_HEAD_KEY, SCORE_HEAD_FILE
    from rltrain.models.tokenizer import load_tokenizer
    from rltrain.models.vision import copy_processor_files
    from rltrain.rewards.vision_model_reward import VisionSequenceReward

    out_dir = tmp_path / "final"
    results = run_ranks(_train_and_export, tiny_vl_dir, out_dir, lora, nproc=nproc, timeout_s=300)
    assert all(torch.equal(r["chosen"], results[0]["chosen"]) and r["loss"] == results[0]["loss"] for r in results)
    assert results[0]["grad_norm"] > 0
    load_tokenizer(tiny_vl_dir).save_pretrained(str(out_dir))  # what export_final adds beside the weights
    copy_processor_files(tiny_vl_dir, out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    assert config[REWARD_HEAD_KEY] == SCORE_HEAD_FILE and "vision_config" in config
    assert not (out_dir / "adapter_config.json").exists()  # LoRA merged, no adapter directory
    exported, base = load_file(str(out_dir / "model.safetensors")), load_file(str(tiny_vl_dir / "model.safetensors"))
    assert sorted(exported) == sorted(base)
    tower = [n for n in base if n.startswith("visual.")]  # the checkpoint's own names, as saved
    assert tower and all(torch.equal(exported[n], base[n]) for n in tower)  # the frozen tower is as loaded
    moved = [n for n in base if n.startswith("model.layers.") and (exported[n] - base[n]).abs().max() > 1e-4]
    assert moved and (not lora or all("_proj." in n for n in moved))  # LoRA: only the adapted projections moved
    assert load_file(str(out_dir / SCORE_HEAD_FILE))["score.weight"].shape == (1, config["text_config"]["hidden_size"])

    reward = VisionSequenceReward(out_dir, torch.device("cpu"), torch.float32, batch_size=3, max_length=1024)
    texts = _texts(tiny_vl_dir)
    for key, column in (("chosen", 1), ("rejected", 2)):
        scores = reward([t[0] for t in texts], [t[column] for t in texts], prompt_images=[t[3] for t in texts])
        assert scores == pytest.approx(results[0][key].tolist(), abs=1e-5)
    # rows 0 and 1 share their prompt text: only the image tells them apart, and it does
    blind = reward([texts[0][0]], [texts[1][1]], prompt_images=[texts[0][3]])
    assert blind[0] != pytest.approx(results[0]["chosen"][1].item(), abs=1e-6)
