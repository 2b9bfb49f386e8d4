"""`backend.cp=2` against `backend.cp=1` on the same 2 gloo ranks and the same batches, in fp32:
log-probabilities, entropies, critic values, losses, gradient norms and every element of each
step's gradients within 1e-5 (the updated weights within 1e-4: AdamW's step is about lr x sign), over ragged rows (shorter than cp, odd lengths, longer than the output head's chunk) in each
layout a micro-batch can take (one rectangle, shared-prompt rows, one padding-free row), with
LoRA and with gradient checkpointing. At cp=1 both ranks are replicas holding the same batches
(the losses are normalised by the global count, so the step is the single-replica one); at cp=2
the two ranks are one replica splitting every row. docs/long-sequences.md."""

from __future__ import annotations

import pytest
import torch
from helpers import run_ranks

pytestmark = pytest.mark.dist

TOL = 1e-5


def _model_dir(heads: int = 4, kv_heads: int = 2):
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=128)
    return build_tiny_model_dir(cfg, seed=7)


def _micro_batches():
    """Ragged rows: a 2-token row (one token per cp rank), odd lengths, a 90-token completion (longer
    than the output head's 32-position chunk set below), and in the second micro-batch a prompt
    shared by three completions (a GRPO group: one packed row under a dense mask) beside one of 1 token."""
    from rltrain.data.batch import SequenceBatch

    unshared = SequenceBatch.from_lists(
        [[4], [5, 6, 7], [8, 9], [10, 11, 12, 13]],
        [[14], [15 + j % 9 for j in range(6)], [20 + j % 7 for j in range(90)], [30, 31, 32]],
    )
    shared = SequenceBatch.from_lists([[4, 5, 6]] * 3 + [[7, 8]], [[9, 10, 11], [12], [13 + j % 5 for j in range(40)], [14, 15, 16, 17, 18]])
    return [unshared, shared]


def _run(rank: int, world: int, model_dir, cp: int, padding_free: bool, lora: bool, checkpointing: bool):
    import rltrain.backends.chunked_head as chunked_head
    from rltrain.algos.sft import sft_loss
    from rltrain.backends.fsdp.engine import FSDPEngine
    from rltrain.config.group_options import FSDPBackendConfig
    from rltrain.config.schema import LoraAdapterConfig, OptimConfig
    from rltrain.data.sharding import sum_over_replicas

    chunked_head.CHUNK_ELEMENTS = 32 * 256  # 32 positions per chunk of the tiny vocabulary
    backend = FSDPBackendConfig(cp=cp, padding_free=padding_free)
    adapters = LoraAdapterConfig(rank=4, alpha=8) if lora else None
    engine = FSDPEngine(
        model_dir, backend, OptimConfig(lr=1e-2, warmup_steps=0), 10, torch.device("cpu"),
        gradient_checkpointing=checkpointing, adapters=adapters,
    )
    widths = []
    engine.lm.model.register_forward_pre_hook(lambda _m, _a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    mbs = _micro_batches()
    tokens = sum_over_replicas(torch.tensor([float(sum(mb.num_completion_tokens for mb in mbs))], dtype=torch.float64), engine.world_size)
    for mb in mbs:
        mb.extras["global_tokens"] = tokens[0].float()
    outs = engine.forward_logps(mbs, with_entropy=True)
    logps = [o.logps.values for o in outs]
    entropy = [o.entropy.values for o in outs]
    grads = _recorded_gradients(engine)
    metrics = [engine.train_step(mbs, sft_loss, with_entropy=True) for _ in range(2)]
    params = torch.cat([t.flatten().float() for _, t in sorted(engine.export_weights())])
    return logps, entropy, metrics, grads, params, widths, _critic(model_dir, backend, mbs)


def _recorded_gradients(engine) -> list[torch.Tensor]:
    """Every trained parameter's whole gradient as the optimizer is about to use it, each step (the
    FSDP2 shards gathered: every rank calls this in the same order)."""
    from torch.distributed.tensor import DTensor

    grads: list[torch.Tensor] = []
    step = engine.optimizer.step

    def recording_step(*args, **kwargs):
        params = [p for group in engine.optimizer.param_groups for p in group["params"] if p.grad is not None]
        grads.append(torch.cat([(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).flatten().float() for p in params]))
        return step(*args, **kwargs)

    engine.optimizer.step = recording_step
    return grads


def _critic(model_dir, backend, mbs):
    """A critic's values and one squared-error step (PPO's value model)."""
    from rltrain.backends.fsdp.engine import FSDPEngine
    from rltrain.config.schema import OptimConfig

    critic = FSDPEngine(model_dir, backend, OptimConfig(lr=1e-2, warmup_steps=0), 10, torch.device("cpu"), value_head_seed=3)
    values = [v.values for v in critic.forward_values(mbs)]

    def value_loss(out, mb):
        return ((out.values.values - 1.0) ** 2).sum() / mb.extras["global_tokens"], {}

    return values, critic.train_step(mbs, value_loss)


def _compare(cp1, cp2):
    for (logps, entropy, metrics, grads, params, widths, critic), want_all in zip(cp2, cp1, strict=True):
        w_logps, w_entropy, w_metrics, w_grads, w_params, w_widths, w_critic = want_all
        # every model call of cp=2 ran half of the row (padded to even): the split happened
        assert widths == [-(-w // 2) for w in w_widths] and max(widths) > 45
        for got, want in zip(logps + entropy + critic[0], w_logps + w_entropy + w_critic[0], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=TOL)
        assert len(grads) == len(w_grads) == 2
        for got, want in zip(grads, w_grads, strict=True):  # each step's gradients, element by element
            torch.testing.assert_close(got, want, rtol=0, atol=TOL)
        for got, want in zip([*metrics, critic[1]], [*w_metrics, w_critic[1]], strict=True):
            assert got.keys() == want.keys()
            for key in want:
                assert got[key] == pytest.approx(want[key], rel=TOL, abs=TOL), key
        # AdamW moves a weight by about lr * sign(gradient): round-off in a near-zero gradient shows
        # as a fraction of lr (1e-2), not of the weight.
        torch.testing.assert_close(params, w_params, rtol=0, atol=1e-2 * 1e-2)


def _both(rank: int, world: int, model_dir, padding_free: bool, lora: bool, checkpointing: bool):
    return (
        _run(rank, world, model_dir, 1, padding_free, lora, checkpointing),
        _run(rank, world, model_dir, 2, padding_free, lora, checkpointing),
    )


@pytest.mark.parametrize(
    ("padding_free", "lora", "checkpointing"),
    [(False, False, False), (True, True, True)],
)
def test_cp2_scores_and_steps_like_cp1(tiny_cache, padding_free, lora, checkpointing):
    results = run_ranks(_both, _model_dir(), padding_free, lora, checkpointing, nproc=2, timeout_s=300)
    _compare([r[0] for r in results], [r[1] for r in results])
