"""`optim.implementation` (rltrain/backends/adamw.py): `auto` keeps each backend's kernels, and the
three kernels take the same steps up to round-off."""

from __future__ import annotations

import pytest
import torch

from rltrain.backends.adamw import build_adamw
from rltrain.config.schema import OptimConfig


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen, device="cpu")) for shape in ((5, 3), (7,), (2, 2, 2))]


def _three_steps(implementation: str) -> list[torch.Tensor]:
    params = _params()
    optimizer = build_adamw(params, OptimConfig(implementation=implementation, weight_decay=0.01), lr=1e-2,
                            backend_default="for-loop")
    gen = torch.Generator(device="cpu").manual_seed(1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, device="cpu")
        optimizer.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize(("implementation", "backend_default", "foreach", "fused"), [
    ("auto", "foreach", True, None),
    ("auto", "for-loop", False, None),
    ("for-loop", "foreach", False, None),
    ("foreach", "for-loop", True, None),
    ("fused", "for-loop", None, True),
])
def test_the_kernels_asked_for_are_the_ones_built(implementation, backend_default, foreach, fused):
    optimizer = build_adamw(_params(), OptimConfig(implementation=implementation), lr=1e-3, backend_default=backend_default)
    group = optimizer.param_groups[0]
    assert (group["foreach"], group["fused"]) == (foreach, fused)


def test_every_kernel_takes_the_same_steps_up_to_round_off():
    start = [p.detach() for p in _params()]
    reference = _three_steps("for-loop")
    assert all(not torch.equal(a, b) for a, b in zip(reference, start, strict=True))
    for implementation in ("foreach", "fused"):
        for got, want in zip(_three_steps(implementation), reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
