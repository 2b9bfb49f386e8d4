"""`backend.cp` that cannot work is refused at config time, one paragraph naming the key and the fix:
cp on one rank, cp not dividing the ranks or the attention heads, cp on megatron (no Transformer
Engine here), cp with a MoE or vision-language model. The composed config goes through
`rltrain.preflight.validate` exactly as `python -m rltrain` does."""

from __future__ import annotations

import pytest
from helpers import compose_config

from rltrain.preflight.validate import validate
from rltrain.preflight.world import data_parallel_size
from rltrain.runtime.errors import UserError


@pytest.fixture(autouse=True)
def _not_under_torchrun(monkeypatch) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["backend.cp=2"], ["backend.cp=2 on one rank", "trainer.nproc=2"]),
        (["backend.cp=2", "trainer.nproc=3"], ["does not divide the 3 ranks", "multiple of 2"]),
        (["backend.cp=4", "trainer.nproc=4", "model.num_heads=2", "model.num_kv_heads=1"], ["model.num_heads=2"]),
        (["backend=megatron", "backend.cp=2", "trainer.nproc=2"], ["Transformer Engine", "backend=fsdp backend.cp=N"]),
        (["model=tiny_moe", "backend.cp=2", "trainer.nproc=2"], ["Mixture-of-Experts", "backend.cp=1"]),
        (["model=tiny_vl", "backend.cp=2", "trainer.nproc=2"], ["vision-language", "backend.cp=1"]),
        (["backend.cp=0"], ["backend.cp=0 must be at least 1"]),
    ],
)
def test_impossible_cp_names_the_key_and_the_fix(overrides: list[str], names: list[str]) -> None:
    with pytest.raises(UserError) as info:
        validate(compose_config(*overrides))
    for name in names:
        assert name in str(info.value)


def test_cp_ranks_are_one_data_parallel_replica() -> None:
    cfg = compose_config("backend.cp=2", "trainer.nproc=4", "model.num_heads=4", "model.num_kv_heads=1")
    validate(cfg)  # key/value heads that cp does not divide are repeated, not refused
    assert data_parallel_size(cfg) == 2
