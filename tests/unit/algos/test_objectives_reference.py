"""rltrain's named objectives against references on random ragged batches, equal to fp32 rounding
in loss and gradient:

- each paper's formula, written here independently on padded [B, T] tensors (GSPO's sequence
  ratio with autograd through the ratio itself, CISPO's clipped detached weight, Dr. GRPO's constant
  normaliser, PPO's clip);
- TRL's own loss code (`GRPOTrainer._compute_loss`, TRL 1.16) where TRL has the objective (TRL
  is pinned with the test tools, requirements/).

Hand-computed values: tests/unit/algos/test_named_objectives.py.
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rltrain.algos.policy_loss import PolicyLossInputs, policy_loss
from rltrain.data.ragged import Ragged

CLIP_LOW, CLIP_HIGH, MAX_LEN = 0.2, 0.28, 12


def random_batch(seed: int, sequences: int = 6):
    """Ragged log-probabilities (1 to MAX_LEN tokens), old ones near them, advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, MAX_LEN + 1, (sequences,), generator=g)
    logps_N = -torch.rand(int(lengths.sum()), generator=g) * 3
    old_N = logps_N + (torch.rand(logps_N.shape, generator=g) - 0.5) * 0.8
    adv_B = torch.randn(sequences, generator=g)
    return lengths, logps_N, old_N, adv_B


def ours(lengths, logps_N, old_N, adv_B, **kwargs):
    """(loss, d loss / d logps_N) of rltrain's policy_loss."""
    leaf = logps_N.clone().requires_grad_(True)
    logps = Ragged.from_lengths(leaf, lengths)
    loss, _ = policy_loss(PolicyLossInputs(
        logps, adv_B, old_logps=Ragged.from_lengths(old_N, lengths), clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
        global_tokens=float(lengths.sum()), global_seqs=float(len(lengths)), max_len=MAX_LEN, **kwargs,
    ))
    loss.backward()
    return loss.detach(), leaf.grad


def padded(lengths, values_N):
    """[B, T] zero-padded rows and the [B, T] mask."""
    rows = torch.split(values_N, lengths.tolist())
    out = torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True)
    mask = torch.arange(out.shape[1])[None, :] < lengths[:, None]
    return out, mask.float()


def reference(lengths, logps_N, old_N, adv_B, objective: str):
    """(loss, gradient) of each paper's objective on padded tensors."""
    leaf = logps_N.clone().requires_grad_(True)
    logp, mask = padded(lengths, leaf)
    old, _ = padded(lengths, old_N)
    adv = adv_B[:, None]
    if objective == "gspo":  # GSPO, eq. 5-7: s_i = (pi/pi_old)^(1/|y_i|), clipped per sequence
        s = torch.exp(((logp - old) * mask).sum(1) / mask.sum(1))
        loss = -torch.minimum(s * adv_B, torch.clamp(s, 1 - CLIP_LOW, 1 + CLIP_HIGH) * adv_B).mean()
    elif objective == "cispo":  # MiniMax-M1, eq. 4: sg(clip(r, 0, 1 + eps_high)) * A * log pi, token mean
        w = torch.clamp(torch.exp(logp - old), max=1 + CLIP_HIGH).detach()
        loss = -(w * adv * logp * mask).sum() / mask.sum()
    else:  # PPO's clip per token, aggregated three ways
        r = torch.exp(logp - old)
        per_token = -torch.minimum(r * adv, torch.clamp(r, 1 - CLIP_LOW, 1 + CLIP_HIGH) * adv) * mask
        if objective == "token_mean":  # DAPO's token-level mean
            loss = per_token.sum() / mask.sum()
        elif objective == "seq_mean_token_mean":  # GRPO's mean of per-sequence means
            loss = (per_token.sum(1) / mask.sum(1)).mean()
        else:  # Dr. GRPO: every sequence summed, over the budget times the sequence count
            loss = per_token.sum() / (MAX_LEN * len(lengths))
    loss.backward()
    return loss.detach(), leaf.grad


CASES = [
    ("gspo", dict(importance_level="sequence", loss_agg="seq_mean_token_mean")),
    ("cispo", dict(kind="cispo", loss_agg="token_mean")),
    ("token_mean", dict(loss_agg="token_mean")),
    ("seq_mean_token_mean", dict(loss_agg="seq_mean_token_mean")),
    ("dr_grpo", dict(loss_agg="seq_mean_token_sum_norm")),
]


@pytest.mark.parametrize("objective, settings", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seed", range(5))
def test_each_objective_equals_its_paper_formula(objective, settings, seed):
    batch = random_batch(seed)
    loss, grad = ours(*batch, **settings)
    want_loss, want_grad = reference(*batch, objective)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)


# --- TRL -------------------------------------------------------------------------------------------

# rltrain's settings -> TRL's (loss_type, importance_sampling_level). TRL's `epsilon_high` is the CISPO
# weight's cap itself; rltrain's cap is 1 + clip_high.
TRL_CASES = [
    ("grpo", "token", dict(loss_agg="seq_mean_token_mean")),
    ("grpo", "sequence", dict(importance_level="sequence", loss_agg="seq_mean_token_mean")),  # GSPO
    ("dapo", "token", dict(loss_agg="token_mean")),
    ("bnpo", "token", dict(loss_agg="token_mean")),
    ("dr_grpo", "token", dict(loss_agg="seq_mean_token_sum_norm")),
    ("cispo", "token", dict(kind="cispo", loss_agg="token_mean")),
]


def trl_loss(lengths, logps_N, old_N, adv_B, loss_type: str, level: str):
    """TRL 1.16's `GRPOTrainer._compute_loss` on one process, with the model's log-probabilities
    replaced by `logps_N` (its only input from the model) and no KL, entropy or vLLM terms."""
    grpo_trainer = importlib.import_module("trl.trainer.grpo_trainer")
    leaf = logps_N.clone().requires_grad_(True)
    logp, mask = padded(lengths, leaf)
    old, _ = padded(lengths, old_N)
    one_process = SimpleNamespace(
        num_processes=1, sync_gradients=True, gather=lambda t: t, reduce=lambda t, reduction: t,
    )
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=0.0, loss_type=loss_type,
        epsilon_low=CLIP_LOW, epsilon_high=1 + CLIP_HIGH if loss_type == "cispo" else CLIP_HIGH,
        # steps_per_generation 1: one step, one process, so TRL's normaliser of dapo/cispo is the token count.
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1), use_vllm=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, max_completion_length=MAX_LEN,
        accelerator=one_process, _entropy_bonus_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
    )
    inputs = {
        "prompt_ids": torch.zeros(len(lengths), 1, dtype=torch.long), "prompt_mask": torch.ones(len(lengths), 1),
        "completion_ids": torch.zeros(logp.shape, dtype=torch.long), "completion_mask": mask,
        "advantages": adv_B, "old_per_token_logps": old, "num_items_in_batch": mask.sum(),
    }
    loss = grpo_trainer.GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("loss_type, level, settings", TRL_CASES, ids=[f"{c[0]}-{c[1]}" for c in TRL_CASES])
@pytest.mark.parametrize("seed", range(3))
def test_each_objective_equals_trls_loss_code(loss_type, level, settings, seed):
    batch = random_batch(100 + seed)
    want_loss, want_grad = trl_loss(*batch, loss_type, level)
    loss, grad = ours(*batch, **settings)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
