"""Imported by the fork server and the rank server (helpers.PRELOAD) before transformers: makes
the venv's side-folder torchvision importable as importing rltrain does in a fresh process
(rltrain/runtime/torchvision_compat.py), because transformers decides once, on import, whether
torchvision exists. The compat module is loaded from its file, under a private name: the servers
import no rltrain module (docs/testing.md, "Start-up")."""

import importlib.util
from pathlib import Path

_path = Path(__file__).resolve().parents[1] / "rltrain" / "runtime" / "torchvision_compat.py"
_spec = importlib.util.spec_from_file_location("_preloaded_torchvision_compat", _path)
assert _spec is not None and _spec.loader is not None
_compat = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_compat)
_compat.make_torchvision_importable()
if importlib.util.find_spec("torchvision") is not None:
    import torchvision  # noqa: F401  (declared ops and all, before transformers looks)
