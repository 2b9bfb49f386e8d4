"""`InFlightRollouts`' checkpoint part (rltrain/algos/rl/inflight_rollouts.py): the prompts submitted and
not trained are written a step's worth per row, in the format generating ahead reads, and read back
in step order. The engine and the collector are stand-ins: only the bookkeeping runs here; a killed
and resumed run is tests/e2e/test_cli_inflight.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

from rltrain.algos.rl.async_rollouts import AsyncRollouts
from rltrain.algos.rl.inflight_rollouts import InFlightRollouts
from rltrain.config.schema import PlacementConfig


def test_untrained_prompts_round_trip_in_the_generate_ahead_format(tmp_path):
    collector = SimpleNamespace(algo_cfg=SimpleNamespace(prompts_per_step=2))
    placement = PlacementConfig(max_staleness=1, weight_update="in_flight")
    saved = InFlightRollouts(collector, SimpleNamespace(), placement, max_steps=10, eval_versions=[])  # type: ignore[arg-type]
    # after step 3's take: steps 4 .. 7 (t + 2 + 2k) submitted, step 4's in completion order
    saved.submitted_through, saved.untrained = 7, [41, 40, 50, 51, 60, 61, 70, 71]
    saved.save_checkpoint(tmp_path)
    rows = json.loads((tmp_path / "rank0.json").read_text())
    assert rows["max_staleness"] == 1
    assert [(r["step"], r["global_index"], r["version"], r["completions"]) for r in rows["pending"]] == [
        (4, [41, 40], 2, None), (5, [50, 51], 3, None), (6, [60, 61], 4, None), (7, [70, 71], 5, None),
    ]
    restored = InFlightRollouts(collector, SimpleNamespace(), placement, max_steps=10, eval_versions=[])  # type: ignore[arg-type]
    restored.load_checkpoint(tmp_path)
    assert restored.restored == [[41, 40], [50, 51], [60, 61], [70, 71]]
    ahead = AsyncRollouts.__new__(AsyncRollouts)  # generating ahead reads the same file: every row, nothing generated
    ahead.rank, ahead.restored = 0, {}
    ahead.load_checkpoint(tmp_path)
    assert ahead.restored == {4: ([41, 40], None), 5: ([50, 51], None), 6: ([60, 61], None), 7: ([70, 71], None)}
