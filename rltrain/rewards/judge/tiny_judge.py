"""A tiny judge for the built-in addition task, the first command of `+experiment=judge_then_grpo`:
`python -m rltrain.rewards.judge.tiny_judge hydra.run.dir=outputs/judge [rltrain overrides]` writes
verdict rows (`TEMPLATE` over a sum, a candidate answer and the reference; `1` right, `0` wrong) into
`<run dir>/rows/`, then becomes (exec) `python -m rltrain algo=sft` on them. Training rows come from
the task's training split; the eval rows are GRPO's held-out problems, so the SFT's `eval/accuracy`
is the judge's verdict accuracy on sums it never saw. Wrong answers are a policy's mistakes from the
SFT start: mostly the units carry forgotten. docs/rewards-and-roles.md, "The LLM judge".
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

from rltrain.data.tasks import Problem, addition_split, one_digit_changed
from rltrain.rewards.judge.prompts import compile_template, render_requests

# The judge's prompt (reward_model.template of the recipe, with reward_model.reference_column=answer):
# the sum, then the candidate answer and the reference right-aligned in fields of one width, so that
# each digit is compared with the digit a fixed distance before it; the verdict is its next token.
TEMPLATE = "{{ prompt }}{{ '%6s' | format((completion | trim)[:6]) }} ref {{ '%6s' | format(reference) }} Score: "
NUM_EVAL, EVAL_SEED = 1000, 0  # GRPO's held-out problems in the recipe
SFT_SETTINGS = ["algo=sft", "model=tiny", "optim.lr=1e-3", "trainer.max_steps=1500", "trainer.eval_every=500"]


def wrong_answer(problem: Problem, rng: random.Random) -> str:
    """A wrong sum of the kinds a policy from the SFT start writes."""
    right = problem.value
    draw = rng.random()
    if problem.carries_from_units and draw < 0.5:
        return problem.forgotten_carry_answer
    if draw < 0.75:
        return one_digit_changed(str(right), rng)
    candidate = right + rng.choice([-10, -1, 1, 10])
    return str(candidate) if candidate >= 0 else str(right + 1)


def verdict_rows(problems: list[Problem], seed: int) -> list[dict[str, str]]:
    """Per problem, the right answer (`1`) and one wrong one (`0`), rendered by `TEMPLATE` as the
    judge will see them in the recipe."""
    rng = random.Random(seed + 7)
    cases = [(p, candidate, verdict) for p in problems for candidate, verdict in ((p.answer, "1"), (wrong_answer(p, rng), "0"))]
    rng.shuffle(cases)
    texts = render_requests(compile_template(TEMPLATE), [p.prompt for p, _, _ in cases], [c for _, c, _ in cases],
                            {"answer": [p.answer for p, _, _ in cases]}, "answer")
    return [{"prompt": text, "completion": verdict} for text, (_, _, verdict) in zip(texts, cases, strict=True)]


def write_rows(directory: Path, seed: int) -> tuple[Path, Path]:
    train, held_out = addition_split(seed, NUM_EVAL, eval_seed=EVAL_SEED)
    directory.mkdir(parents=True, exist_ok=True)
    paths = directory / "train.jsonl", directory / "eval.jsonl"
    for path, rows in zip(paths, (verdict_rows(train, seed), verdict_rows(held_out, seed + 1)), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


def override(argv: list[str], key: str, default: str) -> str:
    return next((a.split("=", 1)[1] for a in argv if a.startswith(key + "=")), default)


def main(argv: list[str]) -> None:
    run_dir = Path(override(argv, "hydra.run.dir", "outputs/judge"))
    train, held_out = write_rows(run_dir / "rows", int(override(argv, "trainer.seed", "0")))
    command = [sys.executable, "-m", "rltrain", *SFT_SETTINGS, f"data.path={train}", f"data.eval_path={held_out}",
               "data.max_eval_samples=2000", f"hydra.run.dir={run_dir}", *(a for a in argv if not a.startswith("hydra.run.dir="))]
    print(f"rltrain: judge rows in {train.parent}; running: {' '.join(command[1:])}", flush=True)
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main(sys.argv[1:])
