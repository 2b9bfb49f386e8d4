"""The train/rollout parity check (rltrain.safety.parity): its limit per precision and setting, and
the error that stops a run whose engine samples from other weights. A whole run stopped by it:
tests/e2e/test_cli_lora.py (a LoRA sync broken on purpose)."""

from __future__ import annotations

import pytest

from rltrain.runtime.errors import UserError
from rltrain.safety.parity import FP32_LIMIT, check_parity, parity_limit


def test_the_auto_limit_holds_fp32_to_round_off_and_leaves_bf16_alone():
    assert parity_limit(None, "fp32") == FP32_LIMIT == 1e-2
    assert parity_limit(None, "bf16-mixed") is None and parity_limit(None, "bf16") is None
    assert parity_limit(0.5, "bf16") == 0.5 and parity_limit(0.0, "fp32") is None


def test_a_gap_above_the_limit_stops_the_run_naming_the_step_the_gap_and_the_key():
    check_parity(5e-5, 1e-2, step=3)  # round-off passes
    check_parity(1e-2, 1e-2, step=3)  # the limit itself passes
    check_parity(7.0, None, step=3)  # no limit: nothing checked
    with pytest.raises(UserError) as err:
        check_parity(7.37, 1e-2, step=2)
    text = str(err.value)
    assert "not sampling from the trainer's weights" in text and "at step 2" in text
    assert "7.37" in text and "safety.max_logprob_diff=0.01" in text
