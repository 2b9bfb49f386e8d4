"""`backend.compile=true` end to end: `python -m rltrain algo=sft` on two FSDP ranks (each decoder
layer compiled, then sharded with `fully_shard`) logs the eager run's losses and gradient norms.

Inductor writes into a cache directory of the test's own, so a run that silently stayed eager
(nothing compiled) fails here, and a warm cache from an earlier run cannot stand in for compiling."""

from __future__ import annotations

import pytest
from cli import SMALL_SFT_RUN_2_RANKS, rltrain, train_rows

pytestmark = pytest.mark.e2e


# Two ranks compiling from an empty cache take a minute or more of CPU: `slow`. `make test` holds the
# mechanism at its cheapest level: compiled layers give eager's losses and gradients without
# recompiling per shape, and a compiled FSDP engine trains (tests/unit/backends/test_compile_layers.py).
@pytest.mark.slow
def test_compiled_sft_on_two_ranks_matches_eager(shared_runs, tmp_path):
    eager_dir = shared_runs.get(*SMALL_SFT_RUN_2_RANKS)
    compiled_dir, inductor_dir = tmp_path / "compiled", tmp_path / "inductor"
    assert "compile: false" in (eager_dir / "config.yaml").read_text()
    rltrain(*SMALL_SFT_RUN_2_RANKS, "backend.compile=true", run_dir=compiled_dir,
            env={"TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)})
    assert "compile: true" in (compiled_dir / "config.yaml").read_text()
    assert any((inductor_dir / "fxgraph").rglob("*")), "inductor compiled no graph"
    eager, compiled = train_rows(eager_dir), train_rows(compiled_dir)
    assert [r["step"] for r in compiled] == [r["step"] for r in eager] == [1, 2, 3]
    for e, c in zip(eager, compiled, strict=True):
        assert c["loss"] == pytest.approx(e["loss"], rel=1e-5, abs=1e-6), (e, c)
        assert c["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-5, abs=1e-6), (e, c)
