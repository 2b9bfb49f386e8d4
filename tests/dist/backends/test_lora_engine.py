"""A LoRA policy on the FSDP engine, 1 rank and 2 ranks over gloo, against transformers.

One optimizer step on the adapters (the base frozen), then: the two layouts agree (loss, grad
norm, merged weights); the policy's log-probabilities are those of a plain transformers model
holding the merged weights; the reference `build_reference` gives (the base with the adapters
off, no engine of its own) equals a separately loaded base model's, although the adapters moved;
a checkpoint holds the adapters and their optimizer state only, and loading it into a fresh engine
restores the weights and the next step exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import compose_config, direct_completion_logps, run_ranks

pytestmark = pytest.mark.dist

PROMPTS = [[3, 40, 41], [3, 50, 52, 60, 61, 7], [9]]
COMPLETIONS = [[22, 23, 2], [70, 71, 72, 73, 74, 75, 76, 2], [30]]
OVERRIDES = (
    "algo=sft", "model.lora.rank=4", "model.lora.alpha=8", "optim.lr=0.05", "optim.warmup_steps=0",
    "optim.schedule=constant", "trainer.max_steps=4",
)


def _model_dir(root: Path) -> Path:
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, cache_dir=str(root))
    return build_tiny_model_dir(cfg, seed=41)


def _nll(n_tokens: int, world: int):
    def loss_fn(out, mb):
        return -out.policy_logps().values.sum() / (n_tokens * world), {}

    return loss_fn


def _worker(rank: int, world: int, cfg_yaml: str, model_dir: str, out_dir: str) -> dict:
    from omegaconf import OmegaConf

    from rltrain.config.run_context import RunContext
    from rltrain.backends import build_engine, build_reference
    from rltrain.data.batch import SequenceBatch
    from rltrain.runtime.distributed import DistInfo

    cfg = OmegaConf.create(cfg_yaml)
    ctx = RunContext(cfg, Path(out_dir), DistInfo(rank, world, rank, torch.device("cpu")), Path(model_dir), None)
    batch = SequenceBatch.from_lists(PROMPTS, COMPLETIONS)
    loss_fn = _nll(sum(map(len, COMPLETIONS)), world)
    policy = build_engine(ctx, "policy", cfg.trainer.max_steps)
    reference, reference_engine = build_reference(ctx, policy, cfg.trainer.max_steps)
    res: dict = {"reference_engine": reference_engine is not None}
    res["step"] = policy.train_step([batch], loss_fn)
    (scored,) = policy.forward_logps([batch])
    (ref_scored,) = reference.forward_logps([batch])
    res["policy"], res["reference"] = scored.logps.values.clone(), ref_scored.logps.values.clone()
    res["merged"] = {name: t.clone() for name, t in policy.export_weights()}
    checkpoint = Path(out_dir) / f"ckpt{world}"
    policy.save_checkpoint(checkpoint)
    res["next_step"] = policy.train_step([batch], loss_fn)
    fresh = build_engine(ctx, "policy", cfg.trainer.max_steps)
    fresh.load_checkpoint(checkpoint)
    res["merged_loaded"] = {name: t.clone() for name, t in fresh.export_weights()}
    res["next_step_loaded"] = fresh.train_step([batch], loss_fn)
    return res


@pytest.fixture(scope="module")
def runs(tiny_cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_engine")
    model_dir = _model_dir(tmp)
    cfg = compose_config(*OVERRIDES)
    from omegaconf import OmegaConf

    yaml = OmegaConf.to_yaml(cfg)
    by_world = {n: run_ranks(_worker, yaml, str(model_dir), str(tmp), nproc=n, timeout_s=240) for n in (1, 2)}
    return model_dir, tmp, by_world


def test_one_and_two_ranks_take_the_same_adapter_step(runs):
    _, _, by_world = runs
    (one,), two = by_world[1], by_world[2]
    for res in two:
        assert res["step"]["loss"] == pytest.approx(one["step"]["loss"], rel=1e-6)
        assert res["step"]["grad_norm"] == pytest.approx(one["step"]["grad_norm"], rel=1e-5)
        assert res["merged"].keys() == one["merged"].keys()
        for name, value in one["merged"].items():
            torch.testing.assert_close(res["merged"][name], value, rtol=0, atol=1e-6)


def test_the_policy_scores_as_transformers_does_with_the_merged_weights(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir, _, by_world = runs
    base = direct_completion_logps(model_dir, PROMPTS, COMPLETIONS)
    for res in [*by_world[1], *by_world[2]]:
        assert float((res["policy"] - base).abs().max()) > 1e-3  # the adapters moved the policy
        merged_dir = tmp_path / f"merged{len(by_world)}"
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        missing, unexpected = model.load_state_dict(res["merged"], strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
        model.save_pretrained(str(merged_dir))
        direct = direct_completion_logps(merged_dir, PROMPTS, COMPLETIONS)
        torch.testing.assert_close(res["policy"], direct, rtol=0, atol=1e-5)


def test_the_reference_is_the_base_with_the_adapters_off_and_costs_no_engine(runs):
    model_dir, _, by_world = runs
    base = direct_completion_logps(model_dir, PROMPTS, COMPLETIONS)
    for res in [*by_world[1], *by_world[2]]:
        assert res["reference_engine"] is False
        torch.testing.assert_close(res["reference"], base, rtol=0, atol=1e-6)


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_only_and_restores_them(runs):
    from torch.distributed.checkpoint import FileSystemReader

    _, tmp, by_world = runs
    for world, results in by_world.items():
        keys = list(FileSystemReader(str(tmp / f"ckpt{world}" / "engine")).read_metadata().state_dict_metadata)
        model_keys = [k for k in keys if k.startswith("model.")]
        optim_keys = [k for k in keys if k.startswith("optim.state.")]
        assert model_keys and all(".lora_" in k for k in model_keys)
        assert optim_keys and all(".lora_" in k for k in optim_keys)
        # A: [r, in], B: [out, r] for 7 projections x 2 layers
        assert len(model_keys) == 2 * 7 * 2
        for res in results:
            for name, value in res["merged"].items():
                torch.testing.assert_close(res["merged_loaded"][name], value, rtol=0, atol=0)
            assert res["next_step_loaded"]["loss"] == res["next_step"]["loss"]
            assert res["next_step_loaded"]["grad_norm"] == res["next_step"]["grad_norm"]
