"""`placement.weight_update=in_flight` refuses prompts with images in one paragraph before it
submits anything (its stream hands the engine token ids only; docs/vision.md). The collector and the
engine are stand-ins: only the submission runs here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rltrain.algos.rl.inflight_rollouts import InFlightRollouts
from rltrain.config.schema import PlacementConfig
from rltrain.runtime.errors import UserError


def test_prompts_with_images_are_refused_before_anything_is_submitted():
    from PIL import Image

    rows = {0: SimpleNamespace(ids=[5, 6], images=[]), 1: SimpleNamespace(ids=[7], images=[Image.new("RGB", (28, 28))])}
    collector = SimpleNamespace(
        algo_cfg=SimpleNamespace(prompts_per_step=2), take_prompts=lambda: [0, 1],
        my_rows=lambda index: [rows[i] for i in index], sampling=lambda step: SimpleNamespace(seed=step),
    )
    requests = []
    engine = SimpleNamespace(request=lambda op, **fields: requests.append(op))
    inflight = InFlightRollouts(collector, engine, PlacementConfig(max_staleness=1, weight_update="in_flight"),
                                max_steps=4, eval_versions=[])
    with pytest.raises(UserError, match="placement.weight_update=in_flight submits token ids only") as err:
        inflight._prompts_through(1)
    assert "placement.weight_update=between_batches" in str(err.value) and "\n" not in str(err.value)
    assert requests == []  # nothing reached the engine
