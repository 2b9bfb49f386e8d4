"""pass@k (Chen et al. 2021's unbiased estimator), mean@K and maj@K on hand-computed cases
(rltrain.run.sampled_metrics, docs/evaluation.md), and the `eval.*` preflight."""

from __future__ import annotations

import pytest
from helpers import compose_config

from rltrain.preflight.validate_eval import validate_eval
from rltrain.run.sampled_metrics import (
    PromptSamples,
    default_ks,
    majority_correct,
    metric_keys,
    metric_sums,
    pass_at_k,
)
from rltrain.runtime.errors import UserError


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 2 / 5),  # 1 - C(3,1)/C(5,1) = 1 - 3/5
        (5, 2, 2, 7 / 10),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 5, 11 / 12),  # 1 - C(7,5)/C(10,5) = 1 - 21/252
        (4, 0, 2, 0.0),  # nothing correct
        (4, 1, 4, 1.0),  # n - c < k: every draw holds the correct one
        (4, 4, 1, 1.0),
        (200, 1, 100, 0.5),  # 1 - C(199,100)/C(200,100) = 1 - 100/200; the coefficients overflow a float
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def test_default_ks_are_powers_of_two_and_k():
    assert default_ks(1) == [1] and default_ks(8) == [1, 2, 4, 8] and default_ks(6) == [1, 2, 4, 6]


def test_the_majority_answer_decides_maj_and_a_tie_goes_to_the_first_seen():
    assert not majority_correct(PromptSamples(["3", "4", "4"], [True, False, False], [1, 0, 0]))
    assert majority_correct(PromptSamples(["7", "8"], [True, False], [1, 0]))
    assert not majority_correct(PromptSamples(["8", "7"], [False, True], [0, 1]))


def test_metric_sums_and_keys_line_up():
    prompts = [
        PromptSamples(["2", "2", "3", "2"], [True, True, False, True], [1.0, 1.0, 0.0, 1.0]),  # c=3
        PromptSamples(["5", "6", "6", "6"], [True, False, False, False], [1.0, 0.0, 0.0, 0.5]),  # c=1
    ]
    sums = metric_sums(prompts, [1, 2, 4])
    assert metric_keys([1, 2, 4], 4) == ["eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/mean@4", "eval/maj@4"]
    # pass@1 = c/n; pass@2 = 1 - C(n-c,2)/C(4,2): 1 - 0/6 and 1 - 3/6; pass@4 = 1 for both
    assert sums == pytest.approx([3 / 4 + 1 / 4, 1.0 + 0.5, 2.0, 3 / 4 + 1.5 / 4, 1.0 + 0.0])


def test_the_preflight_refuses_unusable_eval_settings():
    grpo = compose_config("algo=grpo", "eval.samples=4", "eval.k=[1,4]")
    validate_eval(grpo)
    for settings, message in (
        ({"samples": 4, "k": [8]}, "each k must be between 1 and eval.samples=4"),
        ({"samples": 0, "k": [1]}, "eval.samples=0 draws no samples"),
        ({"samples": 4, "k": None, "temperature": 0.0}, "must be > 0"),
    ):
        cfg = grpo.copy()
        for key, value in settings.items():
            cfg.eval[key] = value
        with pytest.raises(UserError, match=message):
            validate_eval(cfg)
    with pytest.raises(UserError, match="algo=sft env=none has the greedy evaluation only"):
        validate_eval(compose_config("algo=sft", "eval.samples=4"))
