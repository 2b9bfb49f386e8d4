"""Library output a user cannot act on stays off the console, and nothing else is hidden
(rltrain.runtime.library_noise, and the megatron backend package for megatron-core)."""

from __future__ import annotations

import pytest
import torch
from cli import ROOT, python
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from rltrain.runtime.library_noise import quiet_transformers_checkpoint_bars


@pytest.fixture
def restore_tqdm_hook():
    saved = hf_logging.set_tqdm_hook(None)
    hf_logging.set_tqdm_hook(saved)
    yield
    hf_logging.set_tqdm_hook(saved)


def _save_and_load(tmp_path) -> None:
    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    Qwen2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)


def test_checkpoint_bars_are_hidden_and_other_bars_still_show(tmp_path, capfd, restore_tqdm_hook):
    _save_and_load(tmp_path / "before")
    before = capfd.readouterr().err
    assert "Loading weights" in before and "Writing model shards" in before  # what a run showed

    quiet_transformers_checkpoint_bars()
    _save_and_load(tmp_path / "after")
    for _ in hf_logging.tqdm(range(2), desc="Downloading"):
        pass
    after = capfd.readouterr().err
    assert "Loading weights" not in after and "Writing model shards" not in after
    assert "Downloading" in after


def test_a_users_tqdm_hook_keeps_running_and_is_not_wrapped_twice(restore_tqdm_hook):
    seen = []

    def user_hook(factory, args, kwargs):
        seen.append(kwargs.get("desc"))
        return factory(*args, **kwargs)

    hf_logging.set_tqdm_hook(user_hook)
    quiet_transformers_checkpoint_bars()
    quiet_transformers_checkpoint_bars()
    hf_logging.tqdm(range(1), desc="Loading weights").close()
    hf_logging.tqdm(range(1), desc="mine").close()
    assert seen == ["Loading weights", "mine"]
    assert hf_logging.set_tqdm_hook(None).previous is user_hook


IMPORT_VLLM = """
import logging
logging.basicConfig(level=logging.INFO)  # as Hydra's job logging does: the root logger at INFO
if {quiet}:
    from rltrain.runtime.library_noise import quiet_vllm_import
    quiet_vllm_import()
from vllm import LLM
logging.getLogger("vllm.anything").error("an error still shows")
"""


def _run(code: str) -> str:
    """`python -c code`'s stderr: a fresh interpreter's imports, forked from the warm fork server
    (tests/cli.py `python`), which has imported neither vllm nor megatron-core."""
    proc = python("-c", code, timeout=300, env={"PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def test_importing_vllm_logs_nothing_below_its_level_and_warns_nothing(monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")  # as rltrain.rollout sets it
    noisy = _run(IMPORT_VLLM.format(quiet=False))
    if "Triton" not in noisy and "reduce_op" not in noisy:
        pytest.skip("this vLLM build logs and warns nothing at import")
    quiet = _run(IMPORT_VLLM.format(quiet=True))
    assert "Triton" not in quiet and "reduce_op" not in quiet, quiet
    assert "an error still shows" in quiet


IMPORT_MEGATRON = """
import logging
logging.basicConfig(level=logging.INFO)
if {quiet}:
    import rltrain.backends.megatron
import megatron.core.distributed
logging.getLogger("megatron.core.distributed.fsdp.x").warning("a warning still shows")
"""


def test_the_megatron_backend_keeps_megatron_fsdps_import_lines_off_the_console():
    assert "Megatron-FSDP" in _run(IMPORT_MEGATRON.format(quiet=False))  # what a run showed
    quiet = _run(IMPORT_MEGATRON.format(quiet=True))
    assert "Megatron-FSDP" not in quiet, quiet
    assert "a warning still shows" in quiet
