"""`placement.weight_update`, `placement.stream`, `placement.deterministic` (rltrain/preflight/validate_inflight.py,
docs/async.md "Weights in flight"): each combination that cannot work is refused with the fix named."""

from __future__ import annotations

import pytest

from rltrain.preflight.validate import validate
from rltrain.runtime.errors import UserError
from rltrain.serve import compose_run_config

SEPARATE = ["algo=grpo", "model=tiny", "rollout=vllm", "rollout.process=separate", "placement.max_staleness=1"]
IN_FLIGHT = [*SEPARATE, "placement.weight_update=in_flight"]
SERVERS = ["algo=grpo", "model=tiny", "rollout=server", "rollout.servers.spawn=1", "placement.max_staleness=1",
           "placement.weight_update=in_flight"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([*SEPARATE, "placement.stream=true"], r"Add placement\.weight_update=in_flight"),
        ([*SERVERS, "placement.deterministic=true"], r"Set placement\.deterministic=false"),
        (["algo=grpo", "model=tiny", "rollout=vllm", "placement.max_staleness=1", "placement.weight_update=in_flight"],
         r"shares the trainer's process"),
        (["algo=grpo", "model=tiny", "rollout=hf", "placement.weight_update=in_flight"], r"rollout\.process=separate"),
        ([*IN_FLIGHT, "placement.max_staleness=0"], r"Set placement\.max_staleness=1"),
        ([*IN_FLIGHT, "placement.time_sharing=true"], r"placement\.time_sharing=false"),
        ([*IN_FLIGHT, "trainer.nproc=2"], r"Set trainer\.nproc=1"),
        ([*SERVERS, "trainer.nproc=2"], r"Set trainer\.nproc=1"),
        ([*IN_FLIGHT, "algo.dynamic_sampling=true"], r"Set algo\.dynamic_sampling=false"),
        ([*IN_FLIGHT, "placement.update_lag_steps=-1"], r"update_lag_steps=-1 must be"),
        ([*IN_FLIGHT, "model=tiny_vl", "data.task=colours"], r"data\.task=colours prompts with pictures.*between_batches"),
        ([*IN_FLIGHT, "placement.weight_update=sometimes"], r"weight_update='sometimes' is not one of between_batches, in_flight"),
    ],
)
def test_refused_with_the_fix(overrides, message):
    with pytest.raises(UserError, match=message):
        validate(compose_run_config(overrides))


def test_the_modes_that_work_pass():
    validate(compose_run_config(IN_FLIGHT))
    validate(compose_run_config([*IN_FLIGHT, "placement.stream=true", "placement.deterministic=true"]))
    validate(compose_run_config([*SEPARATE, "placement.deterministic=true"]))  # between batches: deterministic already
    validate(compose_run_config([*SERVERS, "placement.stream=true"]))
