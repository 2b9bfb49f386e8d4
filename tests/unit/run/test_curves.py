"""`python -m rltrain.plot`: one PNG, a panel per logged metric, every run drawn and labelled by
the overrides that differ between the runs; a sweep directory stands for its jobs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from rltrain.run.curves import COLUMNS, DPI, PANEL_INCHES, plot_runs, write_run_plot
from rltrain.runtime.errors import UserError


def _run(path: Path, overrides: list[str] | None, rows: list[dict]) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if overrides is not None:
        (path / ".hydra").mkdir()
        (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return path


def _grpo_rows(scale: float) -> list[dict]:
    rows = [
        {"step": s, "loss": scale / s, "reward/mean": 0.1 * s, "policy/kl": 0.01 * s, "policy/clipfrac": 0.0,
         "tokens_per_s": 100.0 * s, "lr": 1e-3, "time/step": 0.1}
        for s in range(1, 5)
    ]
    return rows + [{"step": 4, "eval/accuracy": 0.5 * scale, "eval/reward": "nan"}]


def test_a_sweep_and_a_run_are_overlaid_with_their_overrides_as_labels(tmp_path):
    sweep = tmp_path / "sweep"
    _run(sweep / "0", ["algo=grpo", "optim.lr=1e-3"], _grpo_rows(1.0))
    _run(sweep / "1", ["algo=grpo", "optim.lr=3e-3"], _grpo_rows(2.0))
    (sweep / "2").mkdir()  # a job that failed before logging anything is left out
    single = _run(tmp_path / "outputs" / "run_a", None, [{"step": 1, "loss": 1.0, "lr": 1e-3}])
    out = tmp_path / "figs" / "curves.png"
    assert plot_runs([sweep], out) == {"optim.lr=1e-3", "optim.lr=3e-3"}  # what the sweep varied
    labels = plot_runs([sweep, single], out)
    # Against a run without overrides, algo=grpo differs too; that run is named by its directory.
    assert labels == {"algo=grpo optim.lr=1e-3", "algo=grpo optim.lr=3e-3", "outputs/run_a"}
    # Panels: loss, reward/mean, eval/accuracy, policy/kl, policy/clipfrac, tokens_per_s, lr
    # (eval/reward was never finite and time/step is not plotted): 7 panels in 3 rows of 3.
    with Image.open(out) as image:
        assert image.format == "PNG"
        assert image.size == (int(PANEL_INCHES[0] * COLUMNS * DPI), int((PANEL_INCHES[1] * 3 + 0.6) * DPI))


def test_the_command_line_writes_the_png_and_refuses_a_directory_without_runs(tmp_path):
    run = _run(tmp_path / "r", ["algo=sft"], [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}])
    out = tmp_path / "p.png"
    proc = subprocess.run([sys.executable, "-m", "rltrain.plot", str(run), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "1 runs" in proc.stdout and Image.open(out).size[0] == int(PANEL_INCHES[0] * COLUMNS * DPI)
    (tmp_path / "empty").mkdir()
    proc = subprocess.run([sys.executable, "-m", "rltrain.plot", str(tmp_path / "empty")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "has no metrics.jsonl" in proc.stderr
    with pytest.raises(UserError, match="is not a directory"):
        plot_runs([tmp_path / "missing"], out)


def test_a_run_whose_plot_fails_gets_a_warning_not_an_error(tmp_path, capsys):
    run = _run(tmp_path / "r", None, [{"step": 1, "time/step": 0.1}])  # nothing to plot
    write_run_plot(run)
    assert "warning: could not write" in capsys.readouterr().err
    assert not (run / "plots.png").exists()
