"""Training curves of runs and sweeps, overlaid in one PNG (`python -m rltrain.plot`'s drawing).

One PNG with a panel per metric that any of the runs logged (loss, reward/mean, each eval/* key,
policy/kl, policy/clipfrac, tokens/s, lr, critic/value_loss), against the step, one colour per
run, labelled by the Hydra overrides that differ between the runs (`.hydra/overrides.yaml`; the
directory's name where there is none). A sweep directory stands for all of its jobs. Drawn with
matplotlib's Agg renderer (no display needed) and written atomically. Every run also writes its
own `RUN_DIR/plots.png` when it ends (`write_run_plot`, called by the trainer on rank 0).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from rltrain.launch.sweep import metric_rows, varying_overrides
from rltrain.runtime.errors import UserError, format_error

PLOT_FILE = "plots.png"
# Panels in drawing order; `eval/*` stands for every evaluation key any run logged.
PANEL_KEYS = ("loss", "reward/mean", "eval/*", "policy/kl", "policy/clipfrac", "tokens_per_s", "lr", "critic/value_loss", "critic/explained_variance")
COLUMNS = 3
PANEL_INCHES = (5.0, 3.2)
DPI = 100


@dataclass
class RunCurves:
    label: str
    curves: dict[str, tuple[list[int], list[float]]]  # metric key -> (steps, values)


def expand_run_dirs(paths: list[Path]) -> list[Path]:
    """Each run directory as given; a sweep directory (no metrics.jsonl of its own) as its jobs."""
    runs: list[Path] = []
    for path in paths:
        if not path.is_dir():
            raise UserError(f"{path} is not a directory. Give run directories (with metrics.jsonl) or sweep directories.")
        if (path / "metrics.jsonl").exists():
            runs.append(path)
            continue
        jobs = sorted((p.parent for p in path.glob("*/metrics.jsonl")), key=_job_order)
        if not jobs:
            raise UserError(
                f"{path} has no metrics.jsonl and no job directories with one: give a run directory "
                "(outputs/DATE/TIME_ALGO) or a sweep directory (multirun/DATE/TIME)."
            )
        runs.extend(jobs)
    return runs


def _job_order(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (sys.maxsize, path.name)


def run_labels(runs: list[Path]) -> list[str]:
    """The overrides that differ between the runs, or each directory's name where that says nothing."""
    overrides = [" ".join(_overrides(run)) for run in runs]
    varying = varying_overrides(overrides) if len(runs) > 1 else overrides
    labels = [label or _dir_label(run) for label, run in zip(varying, runs)]
    # Runs of different sweeps may share their overrides: each keeps a label of its own.
    return [f"{label} ({_dir_label(run)})" if labels.count(label) > 1 else label for label, run in zip(labels, runs)]


def _dir_label(run: Path) -> str:
    return f"{run.parent.name}/{run.name}"


def _overrides(run: Path) -> list[str]:
    path = run / ".hydra" / "overrides.yaml"
    return [str(o) for o in (yaml.safe_load(path.read_text()) or [])] if path.exists() else []


def read_curves(run: Path, label: str) -> RunCurves:
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for row in metric_rows(run):
        for key, value in row.items():
            if key == "step" or not _is_plotted(key) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            steps, values = curves.setdefault(key, ([], []))
            steps.append(int(row["step"]))
            values.append(float(value))
    return RunCurves(label, curves)


def _is_plotted(key: str) -> bool:
    return key in PANEL_KEYS or key.startswith("eval/")


def panel_keys(runs: list[RunCurves]) -> list[str]:
    """The metrics any run logged, in PANEL_KEYS order (eval keys sorted in place of `eval/*`)."""
    logged = {key for run in runs for key in run.curves}
    keys: list[str] = []
    for key in PANEL_KEYS:
        keys += sorted(k for k in logged if k.startswith("eval/")) if key == "eval/*" else [key] if key in logged else []
    return keys


def draw(runs: list[RunCurves]):
    """A matplotlib Figure (Agg canvas, no pyplot state) with one panel per logged metric."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    keys = panel_keys(runs)
    if not keys:
        raise UserError("none of the runs logged a metric to plot (loss, reward/mean, eval/*, lr, ...).")
    rows = -(-len(keys) // COLUMNS)
    fig = Figure(figsize=(PANEL_INCHES[0] * COLUMNS, PANEL_INCHES[1] * rows + 0.6), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, COLUMNS, squeeze=False).ravel()
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for ax, key in zip(axes, keys):
        for run, colour in zip(runs, colours):
            if key in run.curves:
                steps, values = run.curves[key]
                ax.plot(steps, values, color=colour, label=run.label, marker="." if len(steps) < 30 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in axes[len(keys) :]:
        ax.set_visible(False)
    handles = {line.get_label(): line for ax in axes for line in ax.get_lines()}
    fig.legend(handles.values(), handles.keys(), loc="upper center", ncol=min(len(handles), 3), fontsize="small")
    _set_margins(fig, rows)
    return fig


# Margins in inches, fixed: `tight_layout` measures every label's text first, a large share of the
# time a short run spends writing its plot. These fit titles, tick labels and the legend row.
LEGEND_INCHES, TITLE_INCHES, XLABEL_INCHES, YTICKS_INCHES, RIGHT_INCHES = 0.6, 0.35, 0.5, 0.75, 0.25


def _set_margins(fig, rows: int) -> None:
    width, height = fig.get_figwidth(), fig.get_figheight()
    axes_width = (width - YTICKS_INCHES * COLUMNS - RIGHT_INCHES) / COLUMNS
    axes_height = (height - LEGEND_INCHES - rows * (TITLE_INCHES + XLABEL_INCHES)) / rows
    fig.subplots_adjust(
        left=YTICKS_INCHES / width, right=1 - RIGHT_INCHES / width,
        bottom=XLABEL_INCHES / height, top=1 - (LEGEND_INCHES + TITLE_INCHES) / height,
        wspace=YTICKS_INCHES / axes_width, hspace=(TITLE_INCHES + XLABEL_INCHES) / axes_height,
    )


def drawn_labels(fig) -> set[str]:
    """The labels of the curves actually on the figure's panels."""
    return {line.get_label() for ax in fig.axes for line in ax.get_lines()}


def plot_runs(paths: list[Path], out: Path) -> set[str]:
    """Write the PNG of `paths` (runs or sweeps) to `out`; returns the labels of the runs drawn."""
    runs = expand_run_dirs([Path(p) for p in paths])
    fig = draw([read_curves(run, label) for run, label in zip(runs, run_labels(runs))])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(out)
    return drawn_labels(fig)


def write_run_plot(run_dir: Path) -> Path | None:
    """The run's own `plots.png`, written when it ends (and then shown in its trackers); None where
    it could not be drawn. A plot is a convenience: a failure to draw it is a warning, never the run's failure."""
    try:
        plot_runs([run_dir], run_dir / PLOT_FILE)
    except Exception as exc:  # noqa: BLE001 - any plotting error leaves a finished run finished
        print(f"rltrain: warning: could not write {run_dir / PLOT_FILE}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return None
    return run_dir / PLOT_FILE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rltrain.plot", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories, or sweep directories (all their jobs)")
    parser.add_argument("--out", type=Path, default=Path(PLOT_FILE), help="the PNG to write (default: ./plots.png)")
    args = parser.parse_args(argv)
    try:
        labels = plot_runs(args.runs, args.out)
    except UserError as exc:
        print(format_error(str(exc)), file=sys.stderr)
        return 2
    print(f"rltrain: {len(labels)} runs -> {args.out}")
    return 0
