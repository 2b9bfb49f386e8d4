"""The heap collection a closed CPU engine leaves owed (rltrain/runtime/process_state.py): made once,
by the next run or engine of the process, and never where nothing is owed; the frozen heap a CPU
engine is built on (rltrain/rollout/vllm_process_state.py)."""

from __future__ import annotations

import gc

import pytest

from rltrain.config.schema import Config
from rltrain.run import trainer
from rltrain.runtime import process_state


def _full_collections(action) -> int:
    started: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            started.append(1)

    gc.callbacks.append(count)
    try:
        action()
    finally:
        gc.callbacks.remove(count)
    return len(started)


def test_an_owed_collection_is_made_once_and_only_when_owed():
    process_state.settle_owed_collection()  # whatever an earlier test left
    assert _full_collections(process_state.settle_owed_collection) == 0
    process_state.owe_collection()
    process_state.owe_collection()
    assert _full_collections(process_state.settle_owed_collection) == 1
    assert _full_collections(process_state.settle_owed_collection) == 0


class _Stop(Exception):
    pass


def test_a_run_settles_what_the_previous_job_owed_before_it_starts(monkeypatch):
    """A sweep's next job (same process) frees the last job's engine before it builds anything."""
    process_state.owe_collection()

    def first_step_of_a_run(timeout_s):
        assert not process_state._COLLECTION_OWED[0], "the run started before settling the owed collection"
        raise _Stop

    monkeypatch.setattr(trainer, "init_distributed", first_step_of_a_run)
    monkeypatch.setattr(trainer, "quiet_transformers_checkpoint_bars", lambda: None)
    with pytest.raises(_Stop):
        trainer.run(Config(), None)  # type: ignore[arg-type]


def test_a_cpu_engine_is_built_on_a_frozen_heap_left_unfrozen_if_the_build_fails():
    """rltrain/rollout/vllm_process_state.py: the collection before building settles an owed one."""
    from rltrain.rollout.vllm_process_state import heap_frozen_for_construction

    process_state.owe_collection()
    gc.unfreeze()
    with heap_frozen_for_construction(cpu=True):
        assert gc.get_freeze_count() > 0 and not process_state._COLLECTION_OWED[0]
    gc.unfreeze()  # a built engine's shutdown does this (vLLM)
    with pytest.raises(RuntimeError, match="the build failed"), heap_frozen_for_construction(cpu=True):
        raise RuntimeError("the build failed")
    assert gc.get_freeze_count() == 0
    with heap_frozen_for_construction(cpu=False):  # CUDA: vLLM's own collections, untouched
        assert gc.get_freeze_count() == 0
