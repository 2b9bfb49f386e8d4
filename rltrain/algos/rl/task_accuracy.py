"""Which held-out answers count as right, and `eval/accuracy/<task>` per reasoning-gym task.

A row of `data=reasoning_gym` is right when its dataset's own `score_answer` gives it full marks (the
reward the run trains with, already computed: no second call), so tasks whose verifier accepts more
than one form of the answer are not undercounted by an exact match; any other row is right when its
text equals its `answer`. Rows carrying `rg_task` are also counted per task (docs/environments.md,
"reasoning-gym").
"""

from __future__ import annotations

from rltrain.data.prompt_data import PromptRow

GYM_REWARD = "rltrain.rewards.reasoning_gym:score_answer"
TASK_COLUMN = "rg_task"


def correct_flags(texts: list[str], rows: list[PromptRow], per_fn: dict[str, list[float]], fn_paths: dict[str, str]) -> list[bool]:
    """One flag per text: full marks from the reasoning-gym verifier where the run scores with it, else exact match."""
    gym = next((name for name, path in fn_paths.items() if path == GYM_REWARD), None)
    flags = []
    for i, (text, row) in enumerate(zip(texts, rows, strict=True)):
        if gym is not None and TASK_COLUMN in row.columns:
            flags.append(per_fn[gym][i] >= 1.0)
        else:
            flags.append(text.strip() == str(row.columns["answer"]).strip())
    return flags


def task_names(rows: list[PromptRow]) -> list[str]:
    """The reasoning-gym tasks of the held-out rows (all ranks'), sorted: every rank sums the same list."""
    return sorted({str(r.columns[TASK_COLUMN]) for r in rows if TASK_COLUMN in r.columns})


def correct_per_task(flags: list[bool], rows: list[PromptRow], tasks: list[str]) -> list[float]:
    """Right answers per task of `tasks` among this rank's rows."""
    counts = dict.fromkeys(tasks, 0.0)
    for flag, row in zip(flags, rows, strict=True):
        if TASK_COLUMN in row.columns:
            counts[str(row.columns[TASK_COLUMN])] += float(flag)
    return [counts[t] for t in tasks]


def accuracy_per_task(sums: list[float], all_rows: list[PromptRow], tasks: list[str]) -> dict[str, float]:
    """`eval/accuracy/<task>`: each task's right answers over its held-out rows."""
    sizes = {t: sum(1 for r in all_rows if str(r.columns.get(TASK_COLUMN)) == t) for t in tasks}
    return {f"eval/accuracy/{t}": float(s / sizes[t]) for t, s in zip(tasks, sums, strict=True)}
