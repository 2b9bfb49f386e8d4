"""The CLI end to end on the embedded default: run directory, config errors, invariances, sweeps,
W&B, resume after a kill, user data. Each run is a real `python -m rltrain` process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli import (
    ROOT,
    SFT_RUN,
    SFT_RUN_2_RANKS,
    SMALL_SFT_RUN_2_RANKS,
    comparable,
    kill_when,
    python,
    ranks_forked,
    read_metrics,
    rltrain,
    torchrun_ranks_env,
    train_rows,
)
from wandb_reader import find_run_file, read_offline_run

pytestmark = pytest.mark.e2e


def test_cfg_job_prints_the_composed_config(tiny_cache):
    out = rltrain("--cfg", "job", "algo=sft").stdout
    assert "trainer:" in out and "max_steps:" in out and "algo:" in out and "name: sft" in out
    hydra_cfg = rltrain("--cfg", "hydra", "--resolve", "algo=sft").stdout  # the run dir is named after the algorithm
    assert re.search(r"dir: outputs/[\d-]+/[\d-]+_sft\n", hydra_cfg), hydra_cfg


# One cold console in make test; each message is composed in-process by
# tests/unit/preflight/test_compose_errors.py, the other three consoles `slow`.
@pytest.mark.parametrize(
    "override, says",
    [
        ("trainer.max_stepz=5", "unknown config key 'trainer.max_stepz'"),
        pytest.param("trainer.max_steps=abc", "bad value for 'trainer.max_steps'", marks=pytest.mark.slow),
        pytest.param("algo.beta=0.1", "there is no 'beta' in 'algo'", marks=pytest.mark.slow),  # a GRPO key under algo=sft
        pytest.param("trainer.max_steps=[1", "cannot parse the override", marks=pytest.mark.slow),
    ],
)
def test_bad_key_or_type_fails_before_any_model_is_built(tmp_path, override, says):
    run_dir = tmp_path / "run"
    proc = rltrain("algo=sft", override, run_dir=run_dir, check=False, timeout=120, warm=False)  # the whole console
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("rltrain: error: ") and says in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and "HYDRA_FULL_ERROR" not in proc.stderr, proc.stderr
    assert not run_dir.exists(), "nothing may be written for a config that does not compose"
    assert "rltrain: model" not in proc.stdout, "no model may be built for a config that does not compose"


def test_sft_run_directory_holds_config_metrics_checkpoints_and_final_model(shared_runs):
    run_dir = shared_runs.get(*SFT_RUN)
    assert (run_dir / "config.yaml").read_text().count("max_steps: 6") == 1
    rows = read_metrics(run_dir)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for r in steps:
        assert {"step", "loss", "lr", "grad_norm", "tokens"} <= set(r)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3, 6]
    # save_every=2 over 6 steps, trainer.keep_checkpoints=2: the two newest.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000004", "step_00000006"]
    final = run_dir / "final"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (final / name).exists()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    ids = torch.tensor([tok("12+34=")["input_ids"]])
    assert model(ids).logits.shape[-1] == model.config.vocab_size


def test_final_model_loads_in_vllm(shared_runs):
    run_dir = shared_runs.get(*SFT_RUN)
    script = (
        "import sys\n"
        "from vllm import LLM, SamplingParams\n"
        "llm = LLM(model=sys.argv[1], dtype='float32', max_model_len=128, enforce_eager=True)\n"
        "out = llm.generate(['12+34='], SamplingParams(max_tokens=4, temperature=0))\n"
        "print('GENERATED', len(out[0].outputs[0].token_ids))\n"
    )
    proc = python("-c", script, str(run_dir / "final"), timeout=300,
                  env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GENERATED" in proc.stdout


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in train_rows(run_dir)]


def test_one_rank_and_two_ranks_give_the_same_losses(shared_runs):
    one, two = _losses(shared_runs.get(*SFT_RUN)), _losses(shared_runs.get(*SFT_RUN_2_RANKS))
    assert len(one) == len(two) == 6
    assert one == pytest.approx(two, rel=1e-4)


def test_micro_batching_does_not_change_the_losses(shared_runs, tmp_path):
    # The shared run's micro-batches hold 4 rows; here 1 (8 micro-batches per step).
    rltrain(*SFT_RUN, "trainer.micro_batch_size=1", "trainer.save_every=0", "logger.wandb.mode=disabled",
            run_dir=tmp_path / "mb1")
    assert _losses(tmp_path / "mb1") == pytest.approx(_losses(shared_runs.get(*SFT_RUN)), rel=1e-4)


def test_torchrun_launch_matches_local_ranks(shared_runs, tmp_path):
    local = shared_runs.get(*SMALL_SFT_RUN_2_RANKS)
    torchrun = Path(sys.executable).parent / "torchrun"
    args = [a for a in SMALL_SFT_RUN_2_RANKS if a != "trainer.nproc=2"]  # torchrun gives the ranks
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "rltrain", *args,
           "logger.wandb.mode=disabled", f"hydra.run.dir={tmp_path / 'tr'}"]
    # The ranks are forked from the rank server although torchrun sets OMP_NUM_THREADS=1 for them
    # (tests/rank_server.py `apply_threads`): the rows below hold them to the local ranks'.
    env = torchrun_ranks_env()
    forked = ranks_forked() if env else 0
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not env or ranks_forked() - forked == 2
    assert _losses(tmp_path / "tr") == pytest.approx(_losses(local), rel=1e-5)
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
        assert (run_dir / "final" / "model.safetensors").exists() and (run_dir / "plots.png").exists()  # logger.plot's default
        assert len(train_rows(run_dir)) == 2
        wb = read_offline_run(find_run_file(run_dir))
        groups.add(wb["group"])
        lrs.add(json.dumps(wb["config"]["optim"]))
    assert len(groups) == 1 and groups != {""}
    assert len(lrs) == 2


def test_wandb_receives_exactly_the_metrics_file(shared_runs):
    run_dir = shared_runs.get(*SFT_RUN)
    wb = read_offline_run(find_run_file(run_dir))
    assert wb["config"]["trainer"]["max_steps"] == 6  # the run's config is the composed config
    for row in read_metrics(run_dir):
        logged = wb["history"][row["step"]]
        for key, value in row.items():
            if key != "step":
                assert logged[key] == pytest.approx(value, rel=1e-12), key


# Two ranks stopped and resumed stay in make test elsewhere: Ctrl-C (test_launch_elastic.py) and a
# rank SIGKILLed under megatron (test_megatron_cli.py); SIGTERM on two ranks is `slow`.
@pytest.mark.parametrize("sig, nproc", [(signal.SIGKILL, 1), pytest.param(signal.SIGTERM, 2, marks=pytest.mark.slow)])
def test_killed_run_resumes_to_the_uninterrupted_result(shared_runs, tmp_path, sig, nproc):
    shared = SFT_RUN if nproc == 1 else SFT_RUN_2_RANKS
    whole = shared_runs.get(*shared)
    common = [*shared, "logger.wandb.mode=disabled"]  # W&B changes no row; the shared run is the whole one
    run_dir = tmp_path / "killed"
    # Killed at the first checkpoint: 4 steps and an evaluation of margin, so a busy machine still
    # kills it before the end.
    kill_when(common, run_dir, run_dir / "checkpoints" / "step_00000002", sig)
    assert len(train_rows(run_dir)) < 6
    rltrain(*common, run_dir=run_dir)
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed if "loss" in r] == list(range(1, 7))
    assert comparable(resumed) == comparable(read_metrics(whole))
