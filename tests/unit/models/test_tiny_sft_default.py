"""RL starts from the SFT'd tiny model by default; SFT and DPO start from the plain tiny model.

algo=grpo chooses model=tiny_sft in its defaults list (conf/algo/grpo.yaml); a `model=` on the
command line must still win, and the other algorithms must be unaffected.
"""

from __future__ import annotations

import pytest
from helpers import compose_config


@pytest.mark.parametrize(
    "overrides, sft_steps",
    [
        ([], 3000),  # `python -m rltrain`: GRPO
        (["algo=grpo", "model.sft_steps=50"], 50),
        (["algo=grpo", "model=tiny"], 0),
        (["algo=sft"], 0),
        (["algo=dpo"], 0),
        (["algo=sft", "model=tiny_sft"], 3000),
    ],
)
def test_which_algorithms_start_from_the_sft_model(overrides, sft_steps):
    assert compose_config(*overrides).model.sft_steps == sft_steps


def test_the_algorithm_still_sets_its_training_keys():
    # algo comes last among the groups in conf/config.yaml: its trainer/optim values must win
    cfg = compose_config()
    assert (cfg.algo.name, cfg.trainer.max_steps) == ("grpo", compose_config("algo=grpo").trainer.max_steps)
    assert compose_config("algo=sft").trainer.max_steps == 1500
