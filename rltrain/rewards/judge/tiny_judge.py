"""A tiny judge for the built-in addition task, the first command of `+experiment=judge_then_grpo`:
`python -m rltrain.rewards.judge.tiny_judge hydra.run.dir=outputs/judge [rltrain overrides]` writes
verdict rows (`TEMPLATE` over a sum, a candidate answer and the reference; `1` right, `0` wrong) into
`<run dir>/rows/`, then becomes (exec) `python -m rltrain algo=sft` on them. Training rows come from
the task's training split; the eval rows are GRPO's held-out problems, so the SFT's `eval/accuracy`
is the judge's verdict accuracy on sums it never saw. Wrong answers are the SFT start's mistakes (the
units carry forgotten, a digit off) and what a policy drifts to (longer, shorter, extra characters,
empty). docs/rewards-and-roles.md, "The LLM judge".
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
# the sum, then the trimmed candidate and the reference right-aligned in fields of one width (at
# least six, the longest completion GRPO samples), laid out character by character in pairs
# (candidate's, reference's) so that every comparison is between neighbouring tokens; the verdict is
# its next token. The fields are equal exactly when the trimmed candidate equals the reference.
TEMPLATE = (
    "{% set c = completion | trim %}{% set w = [6, c | length, reference | length] | max %}"
    "{% set c, r = '%*s' | format(w, c), '%*s' | format(w, reference) %}"
    "{{ prompt }}{% for i in range(w) %}{{ c[i] }}{{ r[i] }} {% endfor %}Score: "
)
NUM_EVAL, EVAL_SEED = 1000, 0  # GRPO's held-out problems in the recipe
FIELD = 6  # the template's narrowest field
VERDICTS_PER_SUM = 3  # training rows per sum: this many right answers and as many wrong ones
SFT_SETTINGS = ["algo=sft", "model=tiny", "optim.lr=1e-3", "trainer.max_steps=3500", "trainer.eval_every=500"]
JUNK = "0123456789 +=-.,ab\n"  # characters of the malformed answers


def near_miss(problem: Problem, rng: random.Random) -> str:
    """A wrong sum of the kinds the SFT start writes: the units carry forgotten, one digit changed,
    off by one or ten."""
    right = problem.value
    draw = rng.random()
    if problem.carries_from_units and draw < 0.5:
        return problem.forgotten_carry_answer
    if draw < 0.75:
        return one_digit_changed(str(right), rng)
    return str(max(0, right + rng.choice([-10, -1, 1, 10])))


def malformed(answer: str, rng: random.Random) -> str:
    """A wrong answer of the kinds a policy drifts to: a digit more or fewer, the answer repeated or
    followed or preceded by other characters, empty, or any short string."""
    draw, at = rng.random(), rng.randrange(len(answer) + 1)
    if draw < 0.25:
        return answer[:at] + rng.choice("0123456789") + answer[at:]
    if draw < 0.4:
        return answer[:at] + answer[at + 1 :]
    if draw < 0.5:
        return (answer * 3)[: rng.randrange(len(answer) + 1, 7)]
    if draw < 0.8:
        extra = "".join(rng.choice(JUNK) for _ in range(rng.randrange(1, 7 - len(answer))))
        return answer + extra if rng.random() < 0.7 else extra + answer
    return "".join(rng.choice(JUNK) for _ in range(rng.randrange(7)))


def one_place_changed(answer: str, rng: random.Random) -> str:
    """The answer right-aligned in the template's field with one place, padding included, holding
    another character: a single pair of the judge's prompt differs, wherever it is."""
    field = list(answer.rjust(FIELD))
    at = rng.randrange(FIELD)
    field[at] = rng.choice([c for c in JUNK if c != field[at]])
    return "".join(field).strip()


def wrong_answer(problem: Problem, rng: random.Random) -> str:
    """A wrong candidate (never the sum once trimmed, as the template trims it): a near miss, one
    place changed or a malformed answer."""
    kinds = (near_miss, lambda p, r: one_place_changed(p.answer, r), lambda p, r: malformed(p.answer, r))
    while True:
        candidate = rng.choices(kinds, weights=(0.35, 0.35, 0.3))[0](problem, rng)
        if candidate.strip() != problem.answer:
            return candidate


def verdict_rows(problems: list[Problem], seed: int, per_sum: int = 1) -> list[dict[str, str]]:
    """Per problem, `per_sum` times the right answer (`1`) and a wrong one (`0`), rendered by
    `TEMPLATE` as the judge will see them in the recipe."""
    rng = random.Random(seed + 7)
    cases = [(p, candidate, verdict) for p in problems for _ in range(per_sum)
             for candidate, verdict in ((p.answer, "1"), (wrong_answer(p, rng), "0"))]
    rng.shuffle(cases)
    texts = render_requests(compile_template(TEMPLATE), [p.prompt for p, _, _ in cases], [c for _, c, _ in cases],
                            {"answer": [p.answer for p, _, _ in cases]}, "answer")
    return [{"prompt": text, "completion": verdict} for text, (_, _, verdict) in zip(texts, cases, strict=True)]


def write_rows(directory: Path, seed: int) -> tuple[Path, Path]:
    train, held_out = addition_split(seed, NUM_EVAL, eval_seed=EVAL_SEED)
    directory.mkdir(parents=True, exist_ok=True)
    paths = directory / "train.jsonl", directory / "eval.jsonl"
    for path, rows in zip(paths, (verdict_rows(train, seed, VERDICTS_PER_SUM), verdict_rows(held_out, seed + 1)), strict=True):
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
