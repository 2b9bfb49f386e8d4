"""The tiny judge's verdict rows (rltrain/rewards/judge/tiny_judge.py): the recipe asks with the
template the judge was trained on, the template's pairs differ exactly where the trimmed answer
differs from the reference (so a policy cannot pass a wrong answer off by its layout), and the
wrong answers are wrong and of the kinds a policy writes."""

from __future__ import annotations

import random

from helpers import compose_config

from rltrain.data.tasks import addition_split
from rltrain.rewards.judge.prompts import compile_template, render_requests
from rltrain.rewards.judge.tiny_judge import TEMPLATE, verdict_rows, wrong_answer

HAND_MADE = ["42", " 42\n", "042", "4 2", "421", "2", "", "42=", "x42", "4242", "32", "1234567"]


def pairs(text: str, prompt: str) -> list[tuple[str, str]]:
    """The (candidate's, reference's) characters the template laid out after `prompt`."""
    body = text[len(prompt) : -len("Score: ")]
    assert text.startswith(prompt) and text.endswith("Score: ") and len(body) % 3 == 0, repr(text)
    return [(body[i], body[i + 1]) for i in range(0, len(body), 3)]


def test_the_recipe_asks_with_the_template_the_judge_learnt():
    assert compose_config("+experiment=judge_then_grpo").reward_model.template == TEMPLATE


def test_the_pairs_differ_exactly_where_the_trimmed_answer_is_not_the_reference():
    rng = random.Random(0)
    problems = addition_split(0, 100)[1]
    candidates = [(p, c) for p in problems for c in (p.answer, wrong_answer(p, rng))]
    candidates += [(problems[0], c) for c in HAND_MADE]
    template = compile_template(TEMPLATE)
    texts = render_requests(template, [p.prompt for p, _ in candidates], [c for _, c in candidates],
                            {"answer": [p.answer for p, _ in candidates]}, "answer")
    assert texts[0] == f"{problems[0].prompt}{'   ' * (6 - len(problems[0].answer))}" + "".join(
        f"{d}{d} " for d in problems[0].answer) + "Score: "
    for (problem, candidate), text in zip(candidates, texts, strict=True):
        laid_out = pairs(text, problem.prompt)
        assert len(laid_out) == max(6, len(candidate.strip()))
        assert all(c == r for c, r in laid_out) == (candidate.strip() == problem.answer), (candidate, text)


def test_wrong_answers_are_wrong_and_of_the_kinds_a_policy_writes():
    rng = random.Random(0)
    problems = addition_split(0, 100)[0][:500]
    wrong = [(p, wrong_answer(p, rng)) for p in problems]
    assert all(w.strip() != p.answer for p, w in wrong)
    assert sum(w == p.forgotten_carry_answer for p, w in wrong) > 20  # the SFT start's mistake
    assert sum(len(w) > len(p.answer) for p, w in wrong) > 50  # too long, or with more text
    assert sum(len(w) < len(p.answer) for p, w in wrong) > 20
    assert sum(w.strip() == "" for _, w in wrong) > 0
    assert sum(not w.strip().isdigit() for _, w in wrong if w.strip()) > 50


def test_verdict_rows_are_balanced_and_rendered_by_the_template():
    problems = addition_split(0, 100)[1][:20]
    rows = verdict_rows(problems, seed=0, per_sum=2)
    assert len(rows) == 80 and sum(r["completion"] == "1" for r in rows) == 40
    assert all(r["prompt"].endswith("Score: ") and r["completion"] in ("0", "1") for r in rows)
