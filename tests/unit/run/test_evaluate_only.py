"""`python -m rltrain.eval`'s console table (rltrain/run/evaluate_only.py, docs/evaluation.md)."""

from __future__ import annotations

from rltrain.run.evaluate_only import results_table


def test_the_table_lists_each_metric_in_order_with_four_decimals():
    assert results_table({"eval/reward": 0.5, "eval/pass@4": 0.123456}).splitlines() == [
        "metric      | value",
        "------------|-------",
        "eval/reward | 0.5000",
        "eval/pass@4 | 0.1235",
    ]
