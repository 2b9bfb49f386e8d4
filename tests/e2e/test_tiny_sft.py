"""`model=tiny_sft`: the SFT start of RL is built once (by the launcher before it starts the ranks,
or by rank 0 alone), cached atomically, and reused.

The cheap test runs the real thing with a small tiny model and a few SFT steps on 2 ranks: the
SFT child must not join a process group of the parent (it would hang until the collective
timeout), and a second run must reuse the cache entry without building. The slow test is the README's claim:
from the default SFT start, GRPO raises held-out exact-match accuracy by at least 0.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from cli import ROOT, read_metrics, rltrain

from rltrain.config.schema import DataConfig, ModelConfig, TrainerConfig
from rltrain.models import tiny_sft
from rltrain.runtime.parent_death import DIE_WITH_PARENT_ENV

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


def test_the_sft_start_is_built_once_and_later_runs_reuse_it(tmp_path):
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
    assert tiny_sft.sft_key(ModelConfig(**SMALL_MODEL, sft_carry_problems=10), data, base) != key
    assert tiny_sft.sft_key(ModelConfig(**SMALL_MODEL, sft_forgotten_carries=0.5), data, base) != key
    assert tiny_sft.sft_key(model, DataConfig(num_eval=300), base) != key  # another held-out split
    assert tiny_sft.sft_key(model, data, tmp_path / "tiny-qwen2-4567") != key  # another spec or seed


def test_the_sft_child_trains_on_the_selected_carrying_sums(tmp_path):
    command = tiny_sft.sft_command(
        ModelConfig(**SMALL_MODEL, sft_carry_problems=300), DataConfig(), TrainerConfig(), tmp_path, tmp_path / "run"
    )
    assert "data.max_carry_problems=300" in command and "data.forgotten_carries=0.0" in command
    assert "data.forgotten_carries=0.8" in tiny_sft.sft_command(
        ModelConfig(**SMALL_MODEL, sft_forgotten_carries=0.8), DataConfig(), TrainerConfig(), tmp_path, tmp_path / "run"
    )
    assert "data.max_carry_problems=null" in tiny_sft.sft_command(
        ModelConfig(**SMALL_MODEL), DataConfig(), TrainerConfig(), tmp_path, tmp_path / "run"
    )


def test_a_failed_build_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    def failing_command(*_args) -> list[str]:
        return [sys.executable, "-c", "import sys; print('sft exploded'); sys.exit(3)"]

    monkeypatch.setattr(tiny_sft, "sft_command", failing_command)
    model = ModelConfig(**SMALL_MODEL, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=r"(?s)exit 3.*sft exploded"):
        tiny_sft.build_sft_model_dir(model, DataConfig(num_eval=4), TrainerConfig(seed=0))
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [tiny_sft.build_tiny_model_dir(model, 0).name]


def test_a_killed_run_leaves_no_sft_child_running(tmp_path):
    """SIGKILL cannot be forwarded: the kernel ends the SFT child when the run that started it dies."""
    cache = tmp_path / "cache"
    args = [*small_run_args(cache), "trainer.nproc=1", "model.sft_steps=100000"]
    log = tmp_path / "run.log"
    with log.open("w") as out:
        run = subprocess.Popen([sys.executable, "-m", "rltrain", *args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT,
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (children := sft_children(cache)):
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        run.kill()
        run.wait()
        deadline = time.monotonic() + 30
        while sft_children(cache) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sft_children(cache) == [], f"the SFT child {children} outlived its SIGKILLed run"
    finally:
        if run.poll() is None:
            run.kill()
        for pid in sft_children(cache):
            os.kill(pid, signal.SIGKILL)


def sft_children(cache) -> list[int]:
    """Live `python -m rltrain algo=sft` processes building into `cache` (not zombies)."""
    listing = subprocess.run(["ps", "-ww", "-eo", "pid=,stat=,args="], capture_output=True, text=True, check=True).stdout
    rows = (line.split(None, 2) for line in listing.splitlines())
    return [int(pid) for pid, stat, args in rows if not stat.startswith("Z") and "algo=sft" in args and str(cache) in args]


def test_the_child_gets_no_launcher_variables(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RLTRAIN_CACHE", "/somewhere")
    env = tiny_sft.child_env()
    assert not {"RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & set(env)
    assert env["RLTRAIN_CACHE"] == "/somewhere"
    assert env[DIE_WITH_PARENT_ENV] == str(os.getpid())  # the child dies with its parent run


def test_an_sft_start_with_a_user_dataset_is_refused_with_the_fix(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(8)))
    proc = rltrain("algo=grpo", f"data.path={data}", f"model.cache_dir={tmp_path / 'cache'}",
                   "reward.fns=[rltrain.rewards.builtin:exact_match]", "logger.wandb.mode=disabled",
                   run_dir=tmp_path / "run", check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "model=tiny_sft" in proc.stderr and "Use model=tiny" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
