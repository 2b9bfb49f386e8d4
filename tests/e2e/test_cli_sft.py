"""The CLI end to end on the embedded default: run directory, config errors, invariances, sweeps,
W&B, resume after a kill, user data. Each run is a real `python -m rltrain` process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli import QUICK, ROOT, comparable, kill_when, read_metrics, rltrain, train_rows
from wandb_reader import find_run_file, read_offline_run

pytestmark = pytest.mark.e2e


def test_cfg_job_prints_the_composed_config(tiny_cache):
    out = rltrain("--cfg", "job", "algo=sft").stdout
    assert "trainer:" in out and "max_steps:" in out and "algo:" in out and "name: sft" in out


@pytest.mark.parametrize(
    "override, says",
    [
        ("trainer.max_stepz=5", "unknown config key 'trainer.max_stepz'"),
        ("trainer.max_steps=abc", "bad value for 'trainer.max_steps'"),
        ("algo.beta=0.1", "there is no 'beta' in 'algo'"),  # a GRPO key under algo=sft
        ("trainer.max_steps=[1", "cannot parse the override"),
    ],
)
def test_bad_key_or_type_fails_before_any_model_is_built(tmp_path, override, says):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = rltrain("algo=sft", override, run_dir=run_dir, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("rltrain: error: ") and says in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and "HYDRA_FULL_ERROR" not in proc.stderr, proc.stderr
    assert not run_dir.exists(), "nothing may be written for a config that does not compose"
    assert time.monotonic() - t0 < 60


def test_sft_run_directory_holds_config_metrics_checkpoints_and_final_model(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain(
        "algo=sft", "trainer.max_steps=4", "trainer.save_every=2", "trainer.eval_every=2",
        "logger.wandb.mode=disabled", "trainer.progress=lines", run_dir=run_dir,
    )
    assert (run_dir / "config.yaml").read_text().count("max_steps: 4") == 1
    rows = read_metrics(run_dir)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert {"step", "loss", "lr", "grad_norm", "tokens"} <= set(r)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    final = run_dir / "final"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (final / name).exists()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    ids = torch.tensor([tok("12+34=")["input_ids"]])
    assert model(ids).logits.shape[-1] == model.config.vocab_size


def test_final_model_loads_in_vllm(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=sft", "trainer.max_steps=1", *QUICK, run_dir=run_dir)
    script = (
        "import sys\n"
        "from vllm import LLM, SamplingParams\n"
        "llm = LLM(model=sys.argv[1], dtype='float32', max_model_len=128, enforce_eager=True)\n"
        "out = llm.generate(['12+34='], SamplingParams(max_tokens=4, temperature=0))\n"
        "print('GENERATED', len(out[0].outputs[0].token_ids))\n"
    )
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(
        [sys.executable, "-c", script, str(run_dir / "final")], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GENERATED" in proc.stdout


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in train_rows(run_dir)]


def test_one_rank_and_two_ranks_give_the_same_losses(tiny_cache, tmp_path):
    common = ["algo=sft", "trainer.max_steps=5", "trainer.global_batch_size=8", "trainer.micro_batch_size=4", *QUICK]
    rltrain(*common, "trainer.nproc=1", run_dir=tmp_path / "n1")
    rltrain(*common, "trainer.nproc=2", run_dir=tmp_path / "n2")
    one, two = _losses(tmp_path / "n1"), _losses(tmp_path / "n2")
    assert len(one) == len(two) == 5
    assert one == pytest.approx(two, rel=1e-4)


def test_micro_batching_does_not_change_the_losses(tiny_cache, tmp_path):
    common = ["algo=sft", "trainer.max_steps=5", "trainer.global_batch_size=8", *QUICK]
    rltrain(*common, "trainer.micro_batch_size=1", run_dir=tmp_path / "mb1")
    rltrain(*common, "trainer.micro_batch_size=8", run_dir=tmp_path / "mb8")
    assert _losses(tmp_path / "mb1") == pytest.approx(_losses(tmp_path / "mb8"), rel=1e-4)


def test_torchrun_launch_matches_local_ranks(tiny_cache, tmp_path):
    common = ["algo=sft", "trainer.max_steps=3", "trainer.global_batch_size=8", *QUICK]
    rltrain(*common, "trainer.nproc=2", run_dir=tmp_path / "local")
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "rltrain", *common, f"hydra.run.dir={tmp_path / 'tr'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _losses(tmp_path / "tr") == pytest.approx(_losses(tmp_path / "local"), rel=1e-5)
    assert (tmp_path / "tr" / "final" / "model.safetensors").exists()


def test_multirun_sweep_makes_complete_runs_in_one_wandb_group(tiny_cache, tmp_path):
    sweep = tmp_path / "sweep"
    rltrain(
        "-m", "algo=sft", "trainer.max_steps=2", "optim.lr=1e-3,3e-3", "logger.wandb.mode=offline",
        "trainer.eval_every=0", "trainer.save_every=0", f"hydra.sweep.dir={sweep}",
    )
    groups, lrs = set(), set()
    for job in ("0", "1"):
        run_dir = sweep / job
        assert (run_dir / "final" / "model.safetensors").exists()
        assert len(train_rows(run_dir)) == 2
        wb = read_offline_run(find_run_file(run_dir))
        groups.add(wb["group"])
        lrs.add(json.dumps(wb["config"]["optim"]))
    assert len(groups) == 1 and groups != {""}
    assert len(lrs) == 2


def test_wandb_receives_exactly_the_metrics_file(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=sft", "trainer.max_steps=3", "trainer.eval_every=2", "trainer.save_every=0",
            "logger.wandb.mode=offline", run_dir=run_dir)
    wb = read_offline_run(find_run_file(run_dir))
    assert wb["config"]["trainer"]["max_steps"] == 3  # the run's config is the composed config
    for row in read_metrics(run_dir):
        logged = wb["history"][row["step"]]
        for key, value in row.items():
            if key != "step":
                assert logged[key] == pytest.approx(value, rel=1e-12), key



@pytest.mark.parametrize("sig, nproc", [(signal.SIGKILL, 1), (signal.SIGTERM, 2)])
def test_killed_run_resumes_to_the_uninterrupted_result(tiny_cache, tmp_path, sig, nproc):
    common = [
        "algo=sft", "trainer.max_steps=8", "trainer.save_every=3", "trainer.eval_every=4", f"trainer.nproc={nproc}",
        "trainer.global_batch_size=8", "logger.wandb.mode=disabled", "trainer.progress=lines",
    ]
    rltrain(*common, run_dir=tmp_path / "whole")
    run_dir = tmp_path / "killed"
    kill_when(common, run_dir, run_dir / "checkpoints" / "step_00000006", sig)
    assert len(train_rows(run_dir)) < 8
    rltrain(*common, run_dir=run_dir)
    resumed, whole = read_metrics(run_dir), read_metrics(tmp_path / "whole")
    assert [r["step"] for r in resumed if "loss" in r] == list(range(1, 9))
    assert comparable(resumed) == comparable(whole)
