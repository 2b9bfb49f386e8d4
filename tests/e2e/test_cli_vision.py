"""Vision-language models end to end (`python -m rltrain`): SFT on a local image dataset on one
rank (its final/ loads with AutoModelForImageTextToText and AutoProcessor), DPO with LoRA on two
ranks, GRPO sampling with images on vLLM at fp32 parity, and images for a text-only model refused
(megatron's refusal: tests/unit/models/test_tiny_vl.py). KTO, PPO, generating ahead, time sharing
and resume with images: test_cli_vision_rl.py; the shared image dataset: tests/vision_data.py."""

from __future__ import annotations

import pytest
from cli import read_metrics, rltrain, train_rows
from vision_data import grpo_vision_run, reward_env

pytestmark = pytest.mark.e2e

SHORT = ["trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "logger.wandb.mode=disabled"]


def test_sft_on_images_writes_a_model_transformers_loads_with_its_processor(tiny_cache, image_data, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=sft", "model=tiny_vl", f"data.path={image_data / 'sft.jsonl'}", *SHORT, run_dir=run_dir, timeout=400)
    rows = train_rows(run_dir)
    assert len(rows) == 2 and all(r["loss"] > 0 for r in rows)
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    final = run_dir / "final"
    model, processor = AutoModelForImageTextToText.from_pretrained(final), AutoProcessor.from_pretrained(final)
    batch = processor(text=["<|vision_start|><|image_pad|><|vision_end|>Colour? "], images=[Image.new("RGB", (28, 28))],
                      return_tensors="pt")
    assert model(**batch).logits.shape[-1] == model.config.text_config.vocab_size


def test_dpo_with_lora_on_two_ranks(tiny_cache, image_data, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=dpo", "model=tiny_vl", f"data.path={image_data / 'pref.jsonl'}", "trainer.nproc=2", "model.lora.rank=4",
            *SHORT, run_dir=run_dir, timeout=400)
    rows = train_rows(run_dir)
    assert len(rows) == 2 and rows[-1]["grad_norm"] > 0
    assert any("dpo/accuracy" in r for r in read_metrics(run_dir))


def test_grpo_samples_with_each_prompts_images_on_vllm_at_fp32_parity(shared_runs, image_data):
    run_dir = shared_runs.get(*grpo_vision_run(image_data), env=reward_env(image_data), timeout=600)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the engine's log-probabilities of its own samples, given the same images, are the trainer's
        assert r["rollout/logprob_diff_max"] < 1e-3 and r["grad_norm"] > 0, r


def test_images_for_a_text_only_model_are_refused_in_one_paragraph(tiny_cache, image_data, tmp_path):
    proc = rltrain("algo=sft", "model=tiny", f"data.path={image_data / 'sft.jsonl'}", *SHORT, run_dir=tmp_path / "run",
                   check=False, timeout=400)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "but the model is text-only" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
