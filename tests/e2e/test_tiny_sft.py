"""`model=tiny_sft`: the SFT start of RL is built once by rank 0, cached atomically, and reused.

The cheap test runs the real thing with a small tiny model and a few SFT steps on 2 ranks: the
SFT child must not join the parent's process group (it would hang until the collective timeout),
and a second run must reuse the cache entry without building. The slow test is the README's claim:
from the default SFT start, GRPO raises held-out exact-match accuracy by at least 0.1.
"""

from __future__ import annotations

import json
import sys

import pytest
from cli import read_metrics, rltrain

from rltrain.config.schema import DataConfig, ModelConfig, TrainerConfig
from rltrain.models import tiny_sft

pytestmark = pytest.mark.e2e

SMALL_MODEL = {
    "hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64, "sft_steps": 3,
}
BUILDING = "building the SFT'd tiny model once"


def small_run_args(cache) -> list[str]:
    return [
        "algo=grpo",  # its default model is tiny_sft: nothing here names the model group
        *(f"model.{k}={v}" for k, v in SMALL_MODEL.items()),
        f"model.cache_dir={cache}",
        "rollout=hf",
        "algo.prompts_per_step=4",
        "algo.group_size=2",
        "trainer.max_steps=1",
        "trainer.nproc=2",
        "data.num_eval=4",
        "safety.collective_timeout_s=120",
        "logger.wandb.mode=disabled",
        "trainer.eval_every=0",
        "trainer.save_every=0",
        "trainer.progress=lines",
    ]


def test_rank0_builds_the_sft_start_once_and_later_runs_reuse_it(tmp_path):
    cache = tmp_path / "cache"
    first = rltrain(*small_run_args(cache), run_dir=tmp_path / "first", timeout=600)
    assert first.stdout.count(BUILDING) == 1, first.stdout[-3000:]

    entries = sorted(p.name for p in cache.iterdir())
    assert len(entries) == 2, entries  # the tiny model and its SFT'd copy; no temporary left behind
    base, sft = cache / entries[0], cache / entries[1]
    assert sft.name.startswith(base.name + "-sft-")
    assert f"rltrain: model {sft}" in first.stdout
    sft_rows = [json.loads(line) for line in (sft / tiny_sft.SFT_METRICS).read_text().splitlines()]
    assert max(r["step"] for r in sft_rows if "loss" in r) == SMALL_MODEL["sft_steps"]
    assert (sft / "model.safetensors").read_bytes() != (base / "model.safetensors").read_bytes()
    stamp = (sft / "model.safetensors").stat().st_mtime_ns

    second = rltrain(*small_run_args(cache), run_dir=tmp_path / "second", timeout=600)
    assert BUILDING not in second.stdout
    assert f"rltrain: model {sft}" in second.stdout
    assert (sft / "model.safetensors").stat().st_mtime_ns == stamp
    assert len(read_metrics(tmp_path / "second")) >= 1


def test_another_sft_setting_is_another_cache_entry(tmp_path):
    model = ModelConfig(**SMALL_MODEL)
    base = tmp_path / "tiny-qwen2-0123"
    data = DataConfig()
    key = tiny_sft.sft_key(model, data, base)
    assert tiny_sft.sft_key(ModelConfig(**{**SMALL_MODEL, "sft_steps": 4}), data, base) != key
    assert tiny_sft.sft_key(ModelConfig(**SMALL_MODEL, sft_lr=2e-3), data, base) != key
    assert tiny_sft.sft_key(model, DataConfig(num_eval=300), base) != key  # another held-out split
    assert tiny_sft.sft_key(model, data, tmp_path / "tiny-qwen2-4567") != key  # another spec or seed


def test_a_failed_build_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    def failing_command(*_args) -> list[str]:
        return [sys.executable, "-c", "import sys; print('sft exploded'); sys.exit(3)"]

    monkeypatch.setattr(tiny_sft, "sft_command", failing_command)
    model = ModelConfig(**SMALL_MODEL, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=r"(?s)exit 3.*sft exploded"):
        tiny_sft.build_sft_model_dir(model, DataConfig(num_eval=4), TrainerConfig(seed=0))
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [tiny_sft.build_tiny_model_dir(model, 0).name]


def test_the_child_gets_no_launcher_variables(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RLTRAIN_CACHE", "/somewhere")
    env = tiny_sft.child_env()
    assert not {"RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & set(env)
    assert env["RLTRAIN_CACHE"] == "/somewhere"


def test_an_sft_start_with_a_user_dataset_is_refused_with_the_fix(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(8)))
    proc = rltrain("algo=grpo", f"data.path={data}", f"model.cache_dir={tmp_path / 'cache'}",
                   "reward.fns=[rltrain.rewards.builtin:exact_match]", "logger.wandb.mode=disabled",
                   run_dir=tmp_path / "run", check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "model=tiny_sft" in proc.stderr and "Use model=tiny" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
