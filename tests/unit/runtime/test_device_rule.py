"""The CPU suite catches the GPU device bug class without a GPU (docs/gpus.md, "Device rule").

On a CPU-only machine every tensor is on the CPU, so a tensor created on the host that meets the
model's outputs, or a control tensor sent through a collective from the wrong module, works here
and crashes on CUDA. Two checks stand in for the GPU:

1. A static check over `rltrain/`: code that builds host-side data next to model outputs
   (`rltrain/algos/`, `rltrain/run/evaluation.py`, `rltrain/rewards/`) names the device of every
   tensor it creates, and calls no collective itself (only `rltrain.runtime.distributed` and the backends'
   internals talk to process groups, through `control_device()`).
2. A dynamic check: every algorithm's loss function is run on model outputs that live on another
   device (`meta`, which refuses to mix with CPU tensors as CUDA does), with the host-side extras
   the algorithm really builds. A loss that forgets to move its inputs raises "... is not on the
   expected device meta".
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rltrain.backends.base import PolicyOutput
from rltrain.data.batch import SequenceBatch
from rltrain.data.ragged import Ragged

PACKAGE = Path(__file__).resolve().parents[3] / "rltrain"
FACTORIES = {"tensor", "zeros", "ones", "full", "empty", "arange", "as_tensor", "randn", "rand"}
COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "gather", "reduce", "reduce_scatter", "send", "recv",
               "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "all_to_all", "scatter"}
HOST_MEETS_MODEL = ["algos", "run/evaluation.py", "rewards"]


def _files(parts: list[str]) -> list[Path]:
    out: list[Path] = []
    for part in parts:
        path = PACKAGE / part
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


def device_rule_violations(source: str, filename: str = "<source>") -> list[str]:
    """Tensor factories without `device=` and direct collective calls in `source`."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if isinstance(owner, ast.Name) and owner.id == "torch" and node.func.attr in FACTORIES:
            if not any(k.arg == "device" for k in node.keywords):
                problems.append(f"{filename}:{node.lineno}: torch.{node.func.attr}(...) without device=")
        if isinstance(owner, ast.Name) and owner.id == "dist" and node.func.attr in COLLECTIVES:
            problems.append(f"{filename}:{node.lineno}: dist.{node.func.attr}(...) outside rltrain.runtime.distributed")
    return problems


def test_host_code_next_to_model_outputs_names_every_device_and_calls_no_collective():
    problems = []
    for path in _files(HOST_MEETS_MODEL):
        problems += device_rule_violations(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not problems, "device rule (docs/gpus.md, 'Device rule'):\n" + "\n".join(problems)


def test_the_static_check_flags_the_bugs_that_crashed_on_cuda():
    # DPO's reference scoring (a host buffer filled from CUDA log-probabilities) and GRPO's engine
    # log-probabilities (built on the host, subtracted from the trainer's on the GPU), as they were.
    dpo = "out = torch.zeros(2, len(pairs), dtype=torch.float64)\nout[0, idx] = c.double()\n"
    grpo = "engine = torch.tensor([lp for c in completions for lp in c.logprobs], dtype=torch.float32)\n"
    collective = "t = torch.tensor([v], dtype=torch.float64, device='cpu')\ndist.all_reduce(t)\n"
    assert len(device_rule_violations(dpo)) == 1
    assert len(device_rule_violations(grpo)) == 1
    assert len(device_rule_violations(collective)) == 1
    assert device_rule_violations("x = torch.zeros(3, device=logps.device)\n") == []


# --- dynamic: losses on outputs that live on another device --------------------------------------------------

OTHER = torch.device("meta")
RL_KEYS = (
    "clip_low", "clip_high", "beta", "loss_agg", "importance_level", "policy_loss", "max_new_tokens", "rollout_is_cap",
    "rollout_mask_band", "rollout_is_floor", "rollout_geo_band", "rollout_icepop_band",
)


def _output(batch: SequenceBatch, with_entropy: bool = False) -> PolicyOutput:
    n = int(batch.completion_lens().sum())
    values = torch.full((n,), -1.0, device=OTHER, requires_grad=True)
    lengths = batch.completion_lens()
    entropy = Ragged.from_lengths(torch.ones(n, device=OTHER), lengths) if with_entropy else None
    return PolicyOutput(Ragged.from_lengths(values, lengths), entropy)


def _batch() -> SequenceBatch:
    return SequenceBatch.from_lists([[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]], [[6, 7], [8], [9, 10, 11], [12]])


def test_sft_loss_runs_where_the_outputs_are():
    from rltrain.algos.sft import sft_loss

    batch = _batch()
    batch.extras["global_tokens"] = float(batch.num_completion_tokens)
    loss, _ = sft_loss(_output(batch), batch)
    assert loss.device == OTHER


def test_dpo_loss_runs_where_the_outputs_are_with_host_reference_sums():
    from rltrain.algos.dpo import dpo_micro_batches, make_dpo_loss
    from rltrain.data.preference_data import PreferencePair

    pairs = [PreferencePair([1, 2], [3, 4], [5]), PreferencePair([6], [7], [8, 9])]
    (mb,), _ = dpo_micro_batches(pairs, 0, 1, 8)
    # As precompute_ref_logps stores them: on the host.
    mb.extras["ref_chosen"] = torch.tensor([-1.0, -2.0], device="cpu")
    mb.extras["ref_rejected"] = torch.tensor([-1.5, -2.5], device="cpu")
    loss, metrics = make_dpo_loss(0.1, "sigmoid", 0.0, 0.1)(_output(mb), mb)
    assert loss.device == OTHER and metrics["dpo/margin"].device == OTHER


def test_kto_loss_runs_where_the_outputs_are_with_host_labels_and_reference_sums():
    from rltrain.algos.kto import kto_micro_batches, make_kto_loss
    from rltrain.data.unpaired_data import LabelledCompletion

    examples = [LabelledCompletion([1, 2], [3, 4], True), LabelledCompletion([6], [7], False)]
    (mb,) = kto_micro_batches(examples, 0, 1, 8, 0, 0.2)
    mb.extras["ref_logps"] = torch.tensor([-1.0, -2.0], device="cpu")  # the host-side labels ride along too
    loss, metrics = make_kto_loss(0.1, 1.0, 1.0)(_output(mb), mb)
    assert loss.device == OTHER and metrics["kto/rewards_chosen"].device == OTHER


def test_grpo_loss_runs_where_the_outputs_are_with_host_advantages_and_engine_logps():
    from rltrain.algos.grpo import GRPOConfig
    from rltrain.algos.rl.update import PolicyBatchInputs, make_policy_loss

    batch = _batch()
    lengths = batch.completion_lens()
    n = int(lengths.sum())
    batch.loss_inputs = PolicyBatchInputs(
        adv=torch.tensor([1.0, -1.0, 0.5, -0.5], device="cpu"),
        old_logps=None, entropy=None, ref_logps=None,
        engine_logps=Ragged.from_lengths(torch.full((n,), -1.0, device="cpu"), lengths),
        measure_parity=True, global_tokens=float(n), global_seqs=4.0,
    )
    for correction in ("none", "tis", "mask", "seq_tis", "seq_mask", "geo_mask", "icepop"):
        cfg = SimpleNamespace(**{k: getattr(GRPOConfig(), k) for k in RL_KEYS}, rollout_correction=correction)
        loss, metrics = make_policy_loss(cfg)(_output(batch, with_entropy=True), batch)
        assert loss.device == OTHER and metrics["rollout/logprob_diff_mean"].device == OTHER, correction
        assert metrics["rollout/mismatch_kl"].device == OTHER, correction


@pytest.mark.parametrize("reference_on", ["cpu", "meta"])
def test_grpo_loss_with_reference_log_probs_on_either_device(reference_on):
    from rltrain.algos.grpo import GRPOConfig
    from rltrain.algos.rl.update import PolicyBatchInputs, make_policy_loss

    batch = _batch()
    lengths = batch.completion_lens()
    n = int(lengths.sum())
    batch.loss_inputs = PolicyBatchInputs(
        adv=torch.tensor([1.0, -1.0, 0.5, -0.5], device="cpu"),
        old_logps=Ragged.from_lengths(torch.full((n,), -1.0, device=reference_on), lengths),
        entropy=Ragged.from_lengths(torch.ones(n, device=reference_on), lengths),
        ref_logps=Ragged.from_lengths(torch.full((n,), -1.2, device=reference_on), lengths),
        engine_logps=Ragged.from_lengths(torch.full((n,), -1.1, device="cpu"), lengths),
        measure_parity=False, global_tokens=float(n), global_seqs=4.0,
    )
    cfg = SimpleNamespace(**{k: getattr(GRPOConfig(), k) for k in RL_KEYS if k != "beta"}, beta=0.05, rollout_correction="tis")
    loss, _ = make_policy_loss(cfg)(_output(batch), batch)
    assert loss.device == OTHER


def test_ppo_value_loss_runs_where_the_outputs_are_with_host_targets():
    from rltrain.algos.ppo import make_value_loss
    from rltrain.algos.rl.update import ValueLossInputs

    batch = _batch()
    lengths = batch.completion_lens()
    n = int(lengths.sum())
    batch.loss_inputs = ValueLossInputs(
        old_values=Ragged.from_lengths(torch.zeros(n, device="cpu"), lengths),
        returns=Ragged.from_lengths(torch.ones(n, device="cpu"), lengths),
        global_tokens=float(n),
    )
    values = Ragged.from_lengths(torch.full((n,), 0.5, device=OTHER, requires_grad=True), lengths)
    loss, metrics = make_value_loss(0.2)(PolicyOutput(None, values=values), batch)
    assert loss.device == OTHER and metrics["critic/vf_clipfrac"].device == OTHER
