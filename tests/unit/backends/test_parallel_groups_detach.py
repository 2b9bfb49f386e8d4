"""ParallelGroups.detach: a discarded engine's model leaves the shared parallel state's re-binding
roots (and can then be freed), the other roots stay."""

from __future__ import annotations

import gc
import weakref

import torch

from rltrain.backends.megatron.groups import ParallelGroups


def test_detach_forgets_only_the_given_roots_so_they_can_be_freed():
    groups = ParallelGroups.__new__(ParallelGroups)  # no process group needed for the roots list
    groups._roots = []
    kept, dropped = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    groups.attach(kept, dropped)
    gone = weakref.ref(dropped)
    groups.detach(dropped)
    del dropped
    gc.collect()
    assert gone() is None
    assert groups._roots == [kept]
