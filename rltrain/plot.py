"""`python -m rltrain.plot RUN_DIR [RUN_DIR ...] [--out plots.png]`: the command; the drawing is
rltrain/run/curves.py (docs/run-directory.md, "Plots")."""

import sys

from rltrain.run.curves import main

if __name__ == "__main__":
    sys.exit(main())
