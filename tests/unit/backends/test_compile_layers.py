"""`backend.compile`: the tiny model's decoder layers compiled by inductor (fp32, CPU) give the
eager model's loss and parameter gradients (1e-5), with activation checkpointing too, through the
FSDP backend's real scorer; a micro-batch of a new shape reuses the compiled graph.

Compiling takes tens of seconds on CPU, so each case compiles one graph (batches of two rows or
more, no attention mask) and checks everything against it.
"""

from __future__ import annotations

import pytest
import torch

from rltrain.backends.fsdp.compile_layers import compile_decoder_layers
from rltrain.backends.fsdp.hf_scoring import CompletionScorer, completion_positions
from rltrain.backends.fsdp.micro_batches.layout import MicroBatchLayout
from rltrain.config.schema import ModelConfig
from rltrain.data.batch import SequenceBatch
from rltrain.models.hf_io import load_causal_lm
from rltrain.models.tiny import build_tiny_model_dir

SMALL = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)


def _micro_batches() -> list[SequenceBatch]:
    """Ragged micro-batches of three different [rows, longest row] shapes, prompts all distinct."""
    g = torch.Generator().manual_seed(3)
    out = []
    for shapes in ([(4, 5), (2, 3), (6, 1)], [(3, 9), (5, 2)], [(2, 2), (7, 4), (3, 3), (1, 6)]):
        prompts = [torch.randint(3, 60, (p,), generator=g).tolist() for p, _ in shapes]
        completions = [torch.randint(3, 60, (c,), generator=g).tolist() for _, c in shapes]
        out.append(SequenceBatch.from_lists(prompts, completions))
    return out


def _train_passes(model_dir, compiled: bool, checkpointing: bool) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """(loss, parameter gradients) of one forward and backward per micro-batch, as the engine
    scores them (one padded rectangle each, as on sharded ranks)."""
    lm = load_causal_lm(model_dir, torch.float32, on_meta=False)
    if checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compiled:
        assert compile_decoder_layers(lm.model.layers) == SMALL.num_layers
    scorer = CompletionScorer(lm).train()
    layout = MicroBatchLayout.for_model(lm.config, 0, torch.device("cpu"), sharded=True, moe=False)
    out = []
    for batch in _micro_batches():
        rects, order_N, _ = layout(batch)
        assert len(rects) == 1 and order_N is None
        _, _, targets_N = completion_positions(batch)
        scorer.zero_grad()
        logps_N, _, _ = scorer(rects, targets_N)
        loss = -logps_N.sum() / logps_N.numel()
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in scorer.named_parameters()}))
    return out


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_compiled_layers_match_eager_and_do_not_recompile_per_shape(tiny_cache, checkpointing):
    from torch._dynamo.utils import counters

    model_dir = build_tiny_model_dir(SMALL, seed=21)
    eager = _train_passes(model_dir, compiled=False, checkpointing=False)
    torch._dynamo.reset()
    counters.clear()
    compiled = _train_passes(model_dir, compiled=True, checkpointing=checkpointing)
    # One graph for every layer and every shape: three [B, T] shapes, two layers.
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    for (loss_e, grads_e), (loss_c, grads_c) in zip(eager, compiled, strict=True):
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
        assert grads_c.keys() == grads_e.keys()
        for name, grad in grads_e.items():
            torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-5, msg=name)
