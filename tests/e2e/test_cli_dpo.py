"""DPO from the command line: metrics, precomputed reference log-probabilities, data checks."""

from __future__ import annotations

import json

import pytest
from cli import DPO_RUN, QUICK, read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

DPO_KEYS = {
    "loss", "dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/margin", "dpo/accuracy",
    "dpo/logps_chosen", "dpo/logps_rejected",
}


def test_precomputed_reference_gives_the_online_losses(shared_runs, tmp_path):
    online_dir = shared_runs.get(*DPO_RUN)  # algo.precompute_ref_logps=false, the default
    assert "precompute_ref_logps: false" in (online_dir / "config.yaml").read_text()
    rltrain(*DPO_RUN, "algo.precompute_ref_logps=true", "trainer.save_every=0", "logger.wandb.mode=disabled",
            run_dir=tmp_path / "pre")
    assert (tmp_path / "pre" / "ref_logps.safetensors").exists()
    online, pre = train_rows(online_dir), train_rows(tmp_path / "pre")
    for a, b in zip(online, pre, strict=True):
        assert DPO_KEYS <= set(a)
        for key in DPO_KEYS - {"dpo/accuracy"}:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    # Accuracy counts margins > 0. At the first step policy == reference, every margin is 0 up to
    # fp32 round-off (which differs with the micro-batch layout), so only later steps compare.
    assert online[0]["dpo/margin"] == pytest.approx(0.0, abs=1e-5)
    for a, b in zip(online[1:], pre[1:], strict=True):
        assert a["dpo/accuracy"] == b["dpo/accuracy"]


def test_dpo_logs_eval_preference_and_task_accuracy(shared_runs):
    run_dir = shared_runs.get(*DPO_RUN)
    evals = [r for r in read_metrics(run_dir) if "eval/dpo_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert all("eval/accuracy" in r for r in evals)


def test_identical_and_empty_pairs_are_skipped_and_counted(tiny_cache, tmp_path):
    rows = [{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a + 2)} for a in range(20)]
    rows += [{"prompt": "1+1=", "chosen": "2", "rejected": "2"}] * 2 + [{"prompt": "1+1=", "chosen": "", "rejected": "3"}]
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    rltrain("algo=dpo", f"data.path={path}", "data.eval_fraction=0", "trainer.max_steps=1", "trainer.global_batch_size=4",
            *QUICK, run_dir=run_dir)
    row = train_rows(run_dir)[0]
    assert row["data/skipped_identical"] == 2 and row["data/skipped_empty"] == 1


def test_missing_rejected_column_is_a_clear_error(tiny_cache, tmp_path):
    path = tmp_path / "sft_style.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    proc = rltrain("algo=dpo", f"data.path={path}", *QUICK, run_dir=tmp_path / "run", check=False)
    assert proc.returncode == 2 and "rejected" in proc.stderr and "Traceback" not in proc.stderr
