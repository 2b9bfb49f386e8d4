"""`ParityProbe` (rltrain/algos/rl/update.py): the running maxima of the step's micro-batches kept as
device tensors and read once give the values a read per micro-batch gave, bit for bit."""

from __future__ import annotations

import torch

from rltrain.algos.rl.update import ParityProbe


def test_the_maxima_read_once_are_the_per_micro_batch_ones():
    generator = torch.Generator().manual_seed(0)
    diffs = [torch.rand(n, generator=generator) * 1e-3 for n in (5, 0, 7, 3)]
    ratios = [torch.exp(torch.randn((), generator=generator)) for _ in range(4)]
    probe = ParityProbe()
    assert probe.max_diff == probe.max_ratio == 0.0
    for d, r in zip(diffs, ratios, strict=True):
        probe.observe(d)
        probe.observe_ratio(r)
    expected_diff = max(0.0, *(float(d.max()) for d in diffs if d.numel()))
    assert probe.max_diff == expected_diff and probe.max_ratio == max(0.0, *(float(r) for r in ratios))
    probe.observe_ratio(torch.tensor(float("nan")))  # skipped, as a float max skipped it
    assert probe.max_ratio == max(float(r) for r in ratios)
    probe.reset()
    assert probe.max_diff == probe.max_ratio == 0.0
