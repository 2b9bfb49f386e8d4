"""A reward model (algo=rm) on either engine, exported as a Hugging Face sequence classifier.

After one Bradley-Terry step, `save_pretrained` writes `final/`'s directory; loaded by
`AutoModelForSequenceClassification` (as `reward_model=hf` loads it), it must give every completion
the reward the engine gave it (1e-5): the classifier reads the last token before the trailing EOS,
the engine the value predicting the EOS, which is the same hidden state. Layouts: FSDP on 1 and 2
ranks (sharded), FSDP with LoRA on 2 ranks (the adapters merged into a plain classifier, which must
differ from the base where they trained; a checkpoint of it restores the scores, head included), Megatron with tp=2 and with pp=2 (the head on the last
stage). The ranks of a run agree with each other. The head is bias-free, like the classifier's
score layer.
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_ranks

pytestmark = pytest.mark.dist

SEED = 5


def _model_dir():
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    return build_tiny_model_dir(ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128), seed=21)


def _pairs(tokenizer):
    from rltrain.data.preference_data import PreferencePair

    def enc(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    eos = tokenizer.eos_token_id
    return [
        PreferencePair(enc(f"{a}+{a * 3}="), enc(str(4 * a)) + [eos], enc(str(4 * a + 7) * (1 + a % 3)) + [eos], 0.5 * (a % 2))
        for a in range(5)
    ]


def _engine(layout: str, model_dir):
    from rltrain.config.schema import LoraAdapterConfig, OptimConfig

    optim = OptimConfig(lr=1e-2, warmup_steps=0)
    if layout.startswith("megatron"):
        from rltrain.backends.megatron.engine import MegatronEngine
        from rltrain.config.group_options import MegatronBackendConfig

        backend = MegatronBackendConfig(tp=2) if layout == "megatron-tp2" else MegatronBackendConfig(pp=2)
        return MegatronEngine(
            model_dir, backend, optim, 10, collective_timeout_s=20, value_head_seed=SEED, value_head_bias=False
        )
    from rltrain.backends.fsdp.engine import FSDPEngine
    from rltrain.config.group_options import FSDPBackendConfig

    adapters = LoraAdapterConfig(rank=8, alpha=16) if layout == "fsdp-lora" else None
    engine = FSDPEngine(
        model_dir, FSDPBackendConfig(), optim, 10, torch.device("cpu"),
        value_head_seed=SEED, value_head_bias=False, adapters=adapters, seed=SEED,
    )
    assert engine.scorer.value_head.bias is None
    return engine


def step_score_and_export(engine, pairs, out_dir) -> dict:
    """One Bradley-Terry step on `pairs` (each micro-batch with its pairs' margins), the rewards the
    engine then gives them, and its `save_pretrained(out_dir)`: what an export test compares the
    exported model with (test_vision_reward_model_export.py too)."""
    from rltrain.algos.preference import preference_micro_batches, score_pairs
    from rltrain.algos.rm import make_reward_model_loss, scored_rewards

    micro, micro_idx = preference_micro_batches(pairs, engine.rank, engine.world_size, 2)
    for mb, idx in zip(micro, micro_idx):
        mb.extras["margins"] = torch.tensor([pairs[i].margin for i in idx])
    metrics = engine.train_step(micro, make_reward_model_loss(0.1))
    chosen, rejected = score_pairs(engine, pairs, score=scored_rewards)
    engine.save_pretrained(out_dir)
    return {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "chosen": chosen, "rejected": rejected}


def _train_and_export(rank, world, model_dir, out_dir, layout):
    from rltrain.algos.preference import score_pairs
    from rltrain.algos.rm import scored_rewards
    from rltrain.models.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    pairs = _pairs(load_tokenizer(model_dir))
    engine = _engine(layout, model_dir)
    res = step_score_and_export(engine, pairs, out_dir)
    if layout == "fsdp-lora":  # a checkpoint keeps the head beside the adapters: a fresh engine scores the same
        engine.save_checkpoint(out_dir.parent / "checkpoint")
        fresh = _engine(layout, model_dir)
        fresh.load_checkpoint(out_dir.parent / "checkpoint")
        res["restored_chosen"] = score_pairs(fresh, pairs, score=scored_rewards)[0]
    return res


@pytest.mark.parametrize(
    "layout, nproc",
    [("fsdp", 1), ("fsdp", 2), ("fsdp-lora", 2), ("megatron-tp2", 2), ("megatron-pp2", 2)],
    ids=["fsdp-1", "fsdp-2", "fsdp-lora-2", "megatron-tp2", "megatron-pp2"],
)
def test_exported_classifier_scores_as_the_engine(tmp_path, layout, nproc):
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    from rltrain.models.tokenizer import load_tokenizer

    model_dir = _model_dir()
    out_dir = tmp_path / "final"
    results = run_ranks(_train_and_export, model_dir, out_dir, layout, nproc=nproc, timeout_s=240)
    assert all(torch.equal(r["chosen"], results[0]["chosen"]) for r in results)
    assert all(r["loss"] == results[0]["loss"] for r in results)
    assert sorted(p.name for p in out_dir.iterdir()) == ["config.json", "model.safetensors"]  # no adapter files
    classifier = AutoModelForSequenceClassification.from_pretrained(str(out_dir), num_labels=1, dtype=torch.float32).eval()
    assert classifier.config.architectures[0].endswith("ForSequenceClassification") and classifier.config.num_labels == 1
    assert classifier.score.bias is None
    exported, base = load_file(str(out_dir / "model.safetensors")), load_file(str(model_dir / "model.safetensors"))
    assert sorted(exported) == sorted({*base} - {"lm_head.weight"} | {"score.weight"})
    if layout == "fsdp-lora":  # trained adapters, merged: the adapted projections moved, the norms did not
        name = "model.layers.0.self_attn.q_proj.weight"
        assert (exported[name] - base[name]).abs().max() > 1e-4
        assert torch.equal(exported["model.norm.weight"], base["model.norm.weight"])
        assert torch.equal(results[0]["restored_chosen"], results[0]["chosen"])
    tok = load_tokenizer(model_dir)
    pairs = _pairs(tok)
    for which, key in (("chosen", "chosen"), ("rejected", "rejected")):
        for i, pair in enumerate(pairs):
            ids = pair.prompt + getattr(pair, which)[:-1]  # the text, without the EOS the data appends
            with torch.no_grad():
                score = classifier(input_ids=torch.tensor([ids])).logits[0, 0]
            assert float(score) == pytest.approx(float(results[0][key][i]), abs=1e-5)
