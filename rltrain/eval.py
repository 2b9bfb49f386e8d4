"""`python -m rltrain.eval model.path=... [data... eval.samples=K ...]`: evaluate a checkpoint's `final/`
or a Hub model without training; the run's command with `eval.only=true` (rltrain/run/evaluate_only.py,
docs/evaluation.md)."""

import sys

from rltrain.__main__ import main

if __name__ == "__main__":
    sys.argv = [sys.argv[0], *sys.argv[1:], "eval.only=true"]
    main()
