"""`trainer.precision` and `model.gradient_checkpointing` on both training backends, on CPU.

For each backend layout (FSDP on 1 unsharded rank, FSDP on 2 sharded ranks, megatron with two
pipeline stages) one spawn builds an engine per setting and takes one SFT step, recording the
dtypes on the way. Checked:

- `bf16-mixed`: the matmuls run in bf16 (a forward hook on an MLP projection sees bf16 outputs),
  while weights, gradients and AdamW state stay fp32 and log-probabilities (returned and seen by
  the loss) are fp32; the loss is within 1% and every log-probability within 0.05 nats of fp32.
- `bf16`: weights and AdamW state in bf16 (megatron keeps its norm weights fp32), log-probs fp32.
- `fp32` (what `auto` is on CPU): everything fp32.
- Activation checkpointing keeps fewer activations for the backward (bytes saved for backward
  outside the checkpointed layers) and changes no number: loss, log-probabilities and every
  gradient equal those without it within 1e-6, in fp32 and in bf16-mixed (the recompute replays
  autocast).
"""

from __future__ import annotations

import pytest
import torch

from helpers import run_ranks

pytestmark = pytest.mark.dist

SETTINGS = [("fp32", False), ("fp32", True), ("bf16-mixed", False), ("bf16-mixed", True), ("bf16", False)]


def _model_dir():
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    return build_tiny_model_dir(cfg, seed=21)


def _batches(seed: int):
    from rltrain.data.batch import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    out = []
    for shapes in ([(4, 5), (2, 3), (6, 1)], [(3, 7), (5, 2)]):
        prompts = [torch.randint(3, 60, (p,), generator=g).tolist() for p, _ in shapes]
        completions = [torch.randint(3, 60, (c,), generator=g).tolist() for _, c in shapes]
        out.append(SequenceBatch.from_lists(prompts, completions))
    return out


def _engine(backend: str, model_dir, precision: str, gc: bool, device: torch.device, shared):
    """`shared`: the SharedObjects of this rank's engines (megatron's are built one after another
    on one parallel state, as a run's roles are)."""
    from rltrain.config.group_options import FSDPBackendConfig, MegatronBackendConfig
    from rltrain.config.schema import OptimConfig

    optim = OptimConfig(lr=1e-2, warmup_steps=0)
    if backend.startswith("megatron"):
        from rltrain.backends.megatron.engine import MegatronEngine

        pp = 2 if backend == "megatron-pp2" else 1
        return MegatronEngine(
            model_dir, MegatronBackendConfig(tp=1, pp=pp), optim, 10, device, precision=precision,
            gradient_checkpointing=gc, shared=shared,
        )
    from rltrain.backends.fsdp.engine import FSDPEngine

    return FSDPEngine(model_dir, FSDPBackendConfig(), optim, 10, device, precision=precision, gradient_checkpointing=gc)


def _probe(eng, backend: str, batches, n_tokens: int) -> dict:
    """One forward_logps and one train step, with the dtypes seen on the way."""
    seen: dict[str, set] = {"matmul": set(), "loss_logps": set(), "loss": set(), "grad": set()}
    if backend.startswith("megatron"):
        proj = eng.model.decoder.layers[0].mlp.linear_fc2  # every stage has layers
        proj.register_forward_hook(lambda m, i, o: seen["matmul"].add(o[0].dtype))
        named = list(eng.model.named_parameters())
    else:
        proj = eng.lm.model.layers[0].mlp.down_proj
        proj.register_forward_hook(lambda m, i, o: seen["matmul"].add(o.dtype))
        named = list(eng.scorer.named_parameters())
    logps = [o.logps.values for o in eng.forward_logps(batches)]
    grads = {}

    def capture(*_):
        for name, p in named:
            # This rank's shard: enough to compare runs of one layout, and no functional
            # collective (DTensor's full_tensor crashes on gloo with CUDA tensors).
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            seen["grad"].add(g.dtype)
            grads[name] = g.float().cpu()

    eng.optimizer.register_step_pre_hook(capture)

    def loss_fn(out, mb):
        seen["loss_logps"].add(out.logps.values.dtype)
        loss = -out.logps.values.sum() / n_tokens
        seen["loss"].add(loss.dtype)
        return loss, {}

    saved = [0]  # bytes kept for the backward outside checkpointed regions (activation memory)

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        metrics = eng.train_step(batches, loss_fn)
    params = [p for _, p in named]
    moments = [v for s in eng.optimizer.state.values() for k, v in s.items() if k != "step"]
    return {
        "loss": metrics["loss"],
        "logps": torch.cat(logps).cpu(),
        "logps_dtype": {lp.dtype for lp in logps},
        "grads": grads,
        "params": {p.dtype for p in params},
        "moments": {m.dtype for m in moments},
        "seen": seen,
        "saved_bytes": saved[0],
    }


def _run(rank: int, world: int, model_dir, backend: str, device: str = "cpu") -> dict:
    """Every setting on this rank. Also run on CUDA by tests/gpu/test_gpu_precision.py."""
    # FSDP ranks hold different data; megatron's two stages are one replica and must hold the same.
    batches = _batches(rank if backend == "fsdp" else 0)
    dp = world if backend == "fsdp" else 1
    n_tokens = dp * sum(b.num_completion_tokens for b in batches)  # same shapes on every rank
    from rltrain.config.run_context import SharedObjects

    out = {}
    shared = SharedObjects()
    for precision, gc in SETTINGS:
        torch.manual_seed(0)
        eng = _engine(backend, model_dir, precision, gc, torch.device(device), shared)
        out[f"{precision}/{gc}"] = _probe(eng, backend, batches, n_tokens)
    return out


@pytest.mark.parametrize("backend, nproc", [("fsdp", 1), ("fsdp", 2), ("megatron-pp2", 2)])
def test_precision_and_activation_checkpointing(tiny_cache, backend, nproc):
    results = run_ranks(_run, _model_dir(), backend, nproc=nproc, timeout_s=300, pg_timeout_s=60)
    check(results, backend)


def check(results: list[dict], backend: str, ckpt_tol: float = 1e-6) -> None:
    """The assertions listed in the module docstring. `ckpt_tol`: how close runs with and without
    activation checkpointing must be (CUDA kernels may order their sums differently)."""
    f32, bf16 = torch.float32, torch.bfloat16
    for res in results:
        fp32, mixed, pure = res["fp32/False"], res["bf16-mixed/False"], res["bf16/False"]
        # fp32: nothing in bf16
        assert fp32["seen"]["matmul"] == {f32} and fp32["params"] == {f32} and fp32["moments"] == {f32}
        # bf16-mixed: bf16 matmuls; fp32 weights, gradients, AdamW state, log-probs and loss
        assert mixed["seen"]["matmul"] == {bf16}
        assert mixed["params"] == {f32} and mixed["moments"] == {f32} and mixed["seen"]["grad"] == {f32}
        for r in (fp32, mixed, pure):  # (only megatron's last stage runs the loss)
            assert r["logps_dtype"] == {f32} and r["seen"]["loss_logps"] <= {f32} and r["seen"]["loss"] <= {f32}
        assert mixed["loss"] == pytest.approx(fp32["loss"], rel=1e-2)
        gap = (mixed["logps"] - fp32["logps"]).abs().max()
        assert 0 < gap < 0.05  # bf16 round-off: visible, small
        # pure bf16: weights and moments in bf16 (megatron keeps RMSNorm weights in fp32)
        assert pure["seen"]["matmul"] == {bf16}
        assert bf16 in pure["params"] and bf16 in pure["moments"]
        if backend == "fsdp":
            assert pure["params"] == {bf16} and pure["moments"] == {bf16}
        assert pure["loss"] == pytest.approx(fp32["loss"], rel=1e-2)
        if res is results[-1]:
            assert mixed["seen"]["loss_logps"] == {f32} and mixed["seen"]["loss"] == {f32}
        # activation checkpointing: the same numbers, in fp32 and in bf16-mixed
        for precision in ("fp32", "bf16-mixed"):
            plain, ckpt = res[f"{precision}/False"], res[f"{precision}/True"]
            assert ckpt["saved_bytes"] < 0.7 * plain["saved_bytes"]  # it did checkpoint
            assert ckpt["loss"] == pytest.approx(plain["loss"], rel=ckpt_tol, abs=ckpt_tol)
            torch.testing.assert_close(ckpt["logps"], plain["logps"], rtol=ckpt_tol, atol=ckpt_tol)
            assert set(ckpt["grads"]) == set(plain["grads"]) and plain["grads"]
            for name, g in plain["grads"].items():
                torch.testing.assert_close(ckpt["grads"][name], g, rtol=ckpt_tol, atol=ckpt_tol, msg=f"{precision} {name}")
