"""No rank outlives the process that started it: the kernel SIGKILLs a rank whose parent dies.

A launcher (ours, `rltrain.launch.local`, or `torchrun`) forwards the signals it receives to its ranks,
but SIGKILL cannot be caught, so a SIGKILLed launcher would leave its ranks running, holding
devices and ports, blocked in a collective. Linux's `PR_SET_PDEATHSIG` asks the kernel to signal
this process when its parent thread exits; the checkpoints stay in the run directory for a resume.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Set to the parent's pid in the environment of a `python -m rltrain` that a run starts itself (the
# SFT start's child run): that child dies with it.
DIE_WITH_PARENT_ENV = "RLTRAIN_DIE_WITH_PARENT"


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when `parent_pid` (its parent) dies; exit now if it already has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        sys.exit(1)
