"""A vision-language model on the FSDP engine scores each row with its own images: the engine's
log-probabilities and its SFT step equal a plain transformers computation that scores every row
alone, on 1 and 2 ranks (rows with one image, two images of different sizes, and none), whatever
the micro-batch split. The tower stays frozen by default and LoRA adapts only the language model."""

from __future__ import annotations

import pytest
import torch
from helpers import run_ranks

from rltrain.models.vision import VISION_MODULE_NAMES

pytestmark = pytest.mark.dist

COLOURS = [(220, 20, 20), (20, 20, 220), (20, 200, 20), (200, 200, 20), (90, 90, 90)]
SIZES = [(56, 56), (28, 28), (56, 28), (28, 56), (84, 56)]
GREEDY_TOKENS = 4


def build_tiny_llava(directory) -> None:
    """A tiny LLaVA (CLIP tower, Llama decoder, the character tokenizer plus `<image>`): the second
    architecture, one both transformers and vLLM support. A 28x28 image is 4 visual tokens."""
    from tokenizers import AddedToken
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from rltrain.models.tokenizer import build_char_tokenizer, padded_vocab_size

    tok = build_char_tokenizer()
    tok.add_tokens([AddedToken("<image>", special=True, normalized=False)], special_tokens=True)
    text = LlamaConfig(vocab_size=padded_vocab_size(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=28, patch_size=14, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default", vision_feature_layer=-1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        LlavaForConditionalGeneration(config).save_pretrained(directory)
    images = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1).save_pretrained(directory)
    tok.save_pretrained(directory)


def build_tiny_qwen25_vl(directory) -> None:
    """A tiny Qwen2.5-VL (windowed vision attention, its own processor class), tiny_vl's text side."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    from rltrain.models.tiny_vl import build_processor, build_vl_tokenizer, tiny_vl_config

    tok = build_vl_tokenizer()
    base = tiny_vl_config(tok).to_dict()
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    ids = {k: base[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    config = Qwen2_5_VLConfig(text_config=base["text_config"], vision_config=vision, tie_word_embeddings=True, **ids)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        Qwen2_5_VLForConditionalGeneration(config).save_pretrained(directory)
    qwen2 = build_processor(tok)
    Qwen2_5_VLProcessor(image_processor=qwen2.image_processor, video_processor=qwen2.video_processor, tokenizer=tok,
                        chat_template=qwen2.chat_template).save_pretrained(directory)
    tok.save_pretrained(directory)


@pytest.fixture(scope="module")
def other_arch_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    {"llava": build_tiny_llava, "qwen2_5_vl": build_tiny_qwen25_vl}[request.param](directory)
    return directory


@pytest.fixture(scope="module")
def sharp_vl_dir(tiny_vl_dir, tmp_path_factory):
    """tiny_vl with its matrices scaled up: its greedy completions differ from image to image, so a
    generation that dropped or mixed up images would show (the seed model's are all alike)."""
    import shutil

    from transformers import AutoModelForImageTextToText

    directory = tmp_path_factory.mktemp("sharp_vl")
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.mul_(6.0)
    model.save_pretrained(directory)
    for f in tiny_vl_dir.iterdir():
        if f.is_file() and not (directory / f.name).exists():
            shutil.copyfile(f, directory / f.name)
    return directory


def _rows(model_dir):
    """(prompt ids, completion ids, VisionInputs or None) of five rows: one image, the same prompt
    and image twice, two images of different sizes, and none."""
    from PIL import Image

    from rltrain.data.vision_rows import RowSource, VisionEncoder
    from rltrain.models.tokenizer import load_tokenizer
    from rltrain.models.vision import load_processor

    tokenizer = load_tokenizer(model_dir)
    encoder = VisionEncoder(load_processor(model_dir, tokenizer))
    source = RowSource("test rows", model_dir)
    rows = []
    for i in range(5):
        first = 0 if i == 1 else i  # rows 0 and 1: one prompt and image, two completions (a GRPO group)
        images = [Image.new("RGB", SIZES[j % 5], COLOURS[j % 5]) for j in range(first, first + (2 if i == 3 else 1))] if i != 4 else []
        prompt = encoder.text_prompt("<image>" * len(images) + f"Row {first}: colour? ", images, i, source)
        ids, vision = encoder.encode(prompt, images)
        completion = tokenizer(["red", "blue", "green", "yellow", "grey"][i], add_special_tokens=False)["input_ids"]
        rows.append((ids, completion + [tokenizer.eos_token_id], vision))
    return rows


def _batch(rows, global_tokens):
    from rltrain.data.batch import SequenceBatch
    from rltrain.data.vision_inputs import vision_extras

    return SequenceBatch.from_lists(
        [r[0] for r in rows], [r[1] for r in rows], global_tokens=global_tokens, **vision_extras([r[2] for r in rows])
    )


def _engine_run(rank, world, model_dir, micro_batch_size, lora_rank, freeze_vision=True):
    from rltrain.algos.sft import sft_loss
    from rltrain.backends.fsdp.engine import FSDPEngine
    from rltrain.config.group_options import FSDPBackendConfig
    from rltrain.config.schema import LoraAdapterConfig, OptimConfig
    from rltrain.data.sharding import micro_batch_count, rank_slice, split_micro_batches
    from rltrain.models.tokenizer import load_tokenizer
    from rltrain.run.evaluation import GreedyEvaluator

    torch.set_num_threads(1)
    rows = _rows(model_dir)
    adapters = LoraAdapterConfig(rank=lora_rank) if lora_rank else None
    engine = FSDPEngine(model_dir, FSDPBackendConfig(), OptimConfig(max_grad_norm=0.0), 10, torch.device("cpu"), adapters=adapters,
                        freeze_vision=freeze_vision)
    mine = rank_slice(list(range(len(rows))), rank, world)
    total = sum(len(r[1]) for r in rows)
    count = micro_batch_count(len(rows), world, micro_batch_size)
    micro = [_batch([rows[i] for i in part], total) for part in split_micro_batches(mine, count, micro_batch_size)]
    per_row = [float(v) for mb, out in zip(micro, engine.forward_logps(micro)) for v in out.logps.sum_per_seq()]
    trainable = [n for n, p in engine.lm.named_parameters() if p.requires_grad]
    # time sharing's offload moves the scorer module (parameters, buffers, optimizer state) to host
    # memory: the tower, frozen or not, must be inside it to move with the rest
    moved = {id(t) for t in [*engine.scorer.parameters(), *engine.scorer.buffers()]}
    tower = [t for n, t in [*engine.lm.named_parameters(), *engine.lm.named_buffers()] if any(f".{m}." in f".{n}" for m in VISION_MODULE_NAMES)]
    evaluator = GreedyEvaluator(model_dir, load_tokenizer(model_dir), torch.float32, GREEDY_TOKENS)
    evaluator.load(engine)  # the held-out path of SFT: left-padded batched generation, each row its images
    greedy = evaluator.generate([r[0] for r in rows], images=[r[2] for r in rows])
    evaluator.release()
    metrics = engine.train_step(micro, sft_loss)
    critic = FSDPEngine(model_dir, FSDPBackendConfig(), None, 10, torch.device("cpu"), value_head_seed=3)  # PPO's
    values = critic.forward_values(micro)
    values_fit = all(torch.equal(v.lengths(), mb.completion_lens()) and bool(torch.isfinite(v.values).all()) for v, mb in zip(values, micro))
    return {"values_fit": values_fit, "greedy": greedy, "rows": mine, "per_row": per_row, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
            "trainable": trainable, "tower_moves": bool(tower) and all(id(t) in moved for t in tower)}


def _plain(model_dir, frozen_tower=True):
    """Per-row completion log-prob sums, and the SFT loss and gradient norm, scoring each row alone."""
    from transformers import AutoModelForImageTextToText

    from rltrain.models.tokenizer import load_tokenizer
    from rltrain.models.vision import freeze_vision, image_token_id

    rows = _rows(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    if frozen_tower:
        freeze_vision(model)
    image_token = image_token_id(model.config)
    grids = model.config.model_type in ("qwen2_vl", "qwen2_5_vl")  # M-RoPE reads which tokens are images
    per_row, total = [], 0.0
    for prompt, completion, vision in rows:
        ids = torch.tensor([prompt + completion])
        extra = dict(vision.tensors) if vision is not None else {}
        if vision is not None and grids:
            extra["mm_token_type_ids"] = (ids == image_token).int()
        logp = torch.log_softmax(model(input_ids=ids, **extra).logits[0, :-1].float(), -1)
        token_logps = logp.gather(-1, ids[0, 1:, None])[:, 0][len(prompt) - 1 :]
        per_row.append(token_logps.sum())
        total = total + token_logps.sum()
    n = sum(len(r[1]) for r in rows)
    loss = -total / n
    greedy = []
    with torch.no_grad():
        for prompt, _, vision in rows:
            ids = torch.tensor([prompt])
            extra = dict(vision.tensors) if vision is not None else {}
            if vision is not None and grids:
                extra["mm_token_type_ids"] = (ids == image_token).int()
            out = model.generate(input_ids=ids, max_new_tokens=GREEDY_TOKENS, do_sample=False, **extra)
            greedy.append(load_tokenizer(model_dir).decode(out[0, len(prompt):], skip_special_tokens=True))
    loss.backward()
    grad_norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return [float(v.detach()) for v in per_row], float(loss.detach()), float(grad_norm), greedy


@pytest.mark.parametrize("nproc, micro_batch_size", [(1, 2), (2, 1)])
def test_engine_scores_and_trains_each_row_with_its_own_images(sharp_vl_dir, nproc, micro_batch_size):
    expected_rows, expected_loss, expected_norm, expected_greedy = _plain(sharp_vl_dir)
    assert len(set(expected_greedy)) >= 3 and expected_greedy[0] == expected_greedy[1]  # images change the output
    results = run_ranks(_engine_run, sharp_vl_dir, micro_batch_size, 0, nproc=nproc, timeout_s=300)
    got = {}
    for r in results:
        got.update(dict(zip(r["rows"], r["per_row"])))
        assert r["loss"] == pytest.approx(expected_loss, rel=1e-5)
        assert r["grad_norm"] == pytest.approx(expected_norm, rel=1e-4)
        assert r["trainable"] and not any(".visual." in n for n in r["trainable"])  # the tower is frozen
        assert r["tower_moves"]  # time sharing offloads and onloads it with the language model
        assert r["values_fit"]  # a critic on the same backbone values each completion token, images and all
        assert r["greedy"] == expected_greedy  # held-out generation sees each prompt's own images
    assert [got[i] for i in range(5)] == pytest.approx(expected_rows, rel=1e-5)


def test_lora_adapts_the_language_model_only(tiny_vl_dir):
    (result,) = run_ranks(_engine_run, tiny_vl_dir, 2, 4, nproc=1, timeout_s=300)
    assert result["trainable"] and all(".lora_" in n for n in result["trainable"])
    assert all(".language_model." in n for n in result["trainable"])
    assert result["grad_norm"] > 0


@pytest.mark.parametrize("other_arch_dir", ["llava", "qwen2_5_vl"], indirect=True)
def test_llava_and_qwen2_5_vl_load_score_and_train_the_same_way(other_arch_dir):
    expected_rows, expected_loss, expected_norm, expected_greedy = _plain(other_arch_dir)
    (result,) = run_ranks(_engine_run, other_arch_dir, 2, 0, nproc=1, timeout_s=300)
    assert result["per_row"] == pytest.approx(expected_rows, rel=1e-5)
    assert result["loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert result["grad_norm"] == pytest.approx(expected_norm, rel=1e-4)
    assert result["trainable"] and not any(f".{part}." in n for n in result["trainable"] for part in VISION_MODULE_NAMES)
    assert result["values_fit"] and result["greedy"] == expected_greedy


def test_an_unfrozen_tower_trains_on_two_ranks_whose_micro_batches_differ_in_images(tiny_vl_dir):
    """Rank 1's second micro-batch has no image and its third is empty; the tower still gets one
    consistent gradient (the plain computation's)."""
    expected_rows, expected_loss, expected_norm, _ = _plain(tiny_vl_dir, frozen_tower=False)
    frozen_norm = _plain(tiny_vl_dir)[2]
    results = run_ranks(_engine_run, tiny_vl_dir, 1, 0, False, nproc=2, timeout_s=300)
    for r in results:
        assert any(".visual." in n for n in r["trainable"])
        assert r["loss"] == pytest.approx(expected_loss, rel=1e-5)
        assert r["grad_norm"] == pytest.approx(expected_norm, rel=1e-4) and r["grad_norm"] != pytest.approx(frozen_norm, rel=1e-4)
