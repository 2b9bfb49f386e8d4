"""torchvision for vision-language models beside the CPU torch, without touching site-packages.

The Qwen2-VL image processors and vLLM's Qwen2-VL module import torchvision. The only torchvision
that matches torch 2.13 on PyPI is the CUDA build: beside torch 2.13.0+cpu its C++ ops library
cannot load and its import then fails ("operator torchvision::nms does not exist"), breaking every
transformers model import. So `make install` puts torchvision in a folder of its own inside the
venv, and importing rltrain puts it on the path (`make_torchvision_importable`); a process that
never imports rltrain does not see it. docs/vision.md.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

# Where `make install` puts torchvision on CPU machines (Makefile, TORCHVISION_DIR).
TORCHVISION_DIR = Path(sys.prefix) / "torchvision-cpu-torch"

# The ops torchvision's import registers fake kernels for whether or not its C++ library loaded.
UNGUARDED_OP_SCHEMAS = {
    "torchvision::nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "torchvision::qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


class TorchvisionMissing(ImportError):
    """No torchvision where a vision-language model needs one."""


class _DeclareOpsFirst(importlib.abc.MetaPathFinder):
    """On the first `import torchvision`: declare the ops its import needs where its C++ library
    cannot load, then step aside for the normal import."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            if not _ops_library_loads():
                _declare_unguarded_ops()
        return None


def make_torchvision_importable(directory: Path = TORCHVISION_DIR) -> None:
    """Put `directory`'s torchvision on the path where the environment has none, its ops declared
    when it is imported. Cheap (imports nothing), called when rltrain is imported so that every
    process, transformers' cached "is torchvision available" included, sees one answer."""
    if "torchvision" in sys.modules or any(isinstance(f, _DeclareOpsFirst) for f in sys.meta_path):
        return
    if importlib.util.find_spec("torchvision") is None:
        if not (directory / "torchvision" / "__init__.py").exists():
            return
        sys.path.append(str(directory))
    sys.meta_path.insert(0, _DeclareOpsFirst())


def ensure_torchvision(directory: Path = TORCHVISION_DIR):
    """Import torchvision and return it (the environment's, else `directory`'s), or say how to
    install one. Detection ops (nms, roi_align) of a build whose C++ library cannot load raise when
    called; the image transforms the vision models use work."""
    make_torchvision_importable(directory)
    if importlib.util.find_spec("torchvision") is None:
        raise TorchvisionMissing(
            f"Vision-language models need torchvision, and there is none in this environment nor in "
            f"{directory}. Run `make install` (it puts a torchvision matching the pinned torch there), "
            "or pip install the torchvision build that matches your torch."
        )
    import torchvision

    if not _transformers_sees_torchvision():
        raise TorchvisionMissing(
            "transformers was imported before torchvision was made importable, and decided once that there is "
            "none: import rltrain before transformers (python -m rltrain does), so vision-language models work."
        )
    return torchvision


def _transformers_sees_torchvision() -> bool:
    if "transformers.utils.import_utils" not in sys.modules:
        return True
    from transformers.utils.import_utils import is_torchvision_available

    return bool(is_torchvision_available())


def _ops_library_loads() -> bool:
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    library = next(Path(spec.submodule_search_locations[0]).glob("_C*.so"), None)
    if library is None:
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError:
        return False
    return True


def _declare_unguarded_ops() -> None:
    import torch

    for name, schema in UNGUARDED_OP_SCHEMAS.items():
        namespace, op = name.split("::")
        if not hasattr(getattr(torch.ops, namespace), op):
            torch.library.define(name, schema)
