"""torchvision beside the CPU torch: importing rltrain makes the venv's side folder importable (the
CUDA build on CPU machines, whose C++ ops cannot load), and what vision models use works even when
transformers is imported right after; a process that never imports rltrain does not see it. Each
case runs in a fresh process: the import happens once per process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_after_importing_rltrain_transformers_vision_classes_work():
    out = run(
        "import rltrain, torch\n"
        "from transformers import Qwen2ForCausalLM, Qwen2VLImageProcessor, Qwen2VLVideoProcessor\n"
        "from transformers.utils import is_torchvision_available\n"
        "from torchvision.transforms.v2 import functional as F\n"
        "print(is_torchvision_available(), tuple(F.resize(torch.ones(3, 20, 20), [10, 10]).shape))\n"
        "print(type(Qwen2VLImageProcessor()).__name__, type(Qwen2VLVideoProcessor()).__name__)\n"
    )
    assert out.split() == ["True", "(3,", "10,", "10)", "Qwen2VLImageProcessor", "Qwen2VLVideoProcessor"]


def test_a_process_that_does_not_import_rltrain_keeps_todays_imports():
    out = run("import importlib.util, transformers.modeling_utils, sys; print(importlib.util.find_spec('torchvision') is None, 'torchvision' in sys.modules)")
    assert out.split() == ["True", "False"]


def test_without_torchvision_anywhere_the_error_says_how_to_install(tmp_path):
    out = run(
        "import sys\n"
        "sys.modules['rltrain'] = type(sys)('rltrain'); sys.modules['rltrain'].__path__ = ['rltrain']  # skip the root's hook\n"
        "from pathlib import Path\n"
        "from rltrain.runtime.torchvision_compat import ensure_torchvision, TorchvisionMissing\n"
        f"try:\n    ensure_torchvision(Path({str(tmp_path)!r}))\nexcept TorchvisionMissing as e:\n    print(e)\n"
    )
    assert "make install" in out and str(tmp_path) in out
