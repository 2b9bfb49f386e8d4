"""KTO's loss against TRL's own loss code on random ragged batches, equal to fp32 rounding in loss
and gradient: `KTOTrainer._compute_loss` of TRL 1.16 (`loss_type="kto"`, precomputed reference
log-probabilities of the completions and of the mismatched KL completions), driven through a stub
trainer and model on one process. rltrain's side is the loss closure algo=kto hands the engine,
with its reference point from `kto_reference_kl` of the same mismatched log-probabilities. TRL is
pinned with the test tools (requirements/). Hand-computed
values: tests/unit/algos/test_kto_loss.py.
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rltrain.algos.kto import kto_reference_kl, make_kto_loss
from rltrain.data.ragged import Ragged

MAX_LEN = 9


def padded(lengths_B, values_N):
    rows = torch.nn.utils.rnn.pad_sequence(list(torch.split(values_N, lengths_B.tolist())), batch_first=True)
    mask = torch.arange(rows.shape[1])[None, :] < lengths_B[:, None]
    return rows, mask


def random_batch(seed: int, examples: int = 7):
    """Ragged completions (1 to MAX_LEN tokens) with labels of both kinds, their mismatched
    completions' policy log-probabilities, and reference sums of both."""
    g = torch.Generator().manual_seed(seed)
    lengths_B = torch.randint(1, MAX_LEN + 1, (examples,), generator=g)
    logps_N = -torch.rand(int(lengths_B.sum()), generator=g) * 3
    labels_B = torch.rand(examples, generator=g) < 0.5
    labels_B[0], labels_B[1] = True, False
    kl_lengths_B = torch.roll(lengths_B, 1)  # completion i-1 for prompt i
    kl_logps_N = -torch.rand(int(kl_lengths_B.sum()), generator=g) * 3
    ref_B = logps_N.new_tensor([float(s.sum()) for s in torch.split(logps_N, lengths_B.tolist())])
    ref_B = ref_B + torch.randn(examples, generator=g) * 2
    ref_kl_B = torch.stack([s.sum() for s in torch.split(kl_logps_N, kl_lengths_B.tolist())])
    ref_kl_B = ref_kl_B - torch.rand(examples, generator=g) * 2 + 0.3  # mostly positive z0, sometimes clamped
    return lengths_B, logps_N, labels_B, kl_lengths_B, kl_logps_N, ref_B, ref_kl_B


def trl_kto(batch, leaf, beta, desirable_weight, undesirable_weight):
    kto_trainer = importlib.import_module("trl.trainer.kto_trainer")
    lengths_B, _, labels_B, kl_lengths_B, kl_logps_N, ref_B, ref_kl_B = batch
    per_token, mask = padded(lengths_B, leaf)
    kl_per_token, kl_mask = padded(kl_lengths_B, kl_logps_N)
    rows, width = per_token.shape

    def layout(m):  # one prompt token, then the completion
        completion_mask = torch.cat([torch.zeros(rows, 1, dtype=torch.long), m.long()], dim=1)
        return torch.zeros(rows, m.shape[1] + 1, dtype=torch.long), completion_mask

    input_ids, completion_mask = layout(mask)
    kl_input_ids, kl_completion_mask = layout(kl_mask)

    def model(input_ids, **kwargs):
        log_probs = kl_per_token if input_ids is kl_input_ids else per_token
        w = log_probs.shape[1]
        return SimpleNamespace(log_probs=log_probs, entropy=torch.zeros(rows, w), mean_logits=torch.zeros(rows, w))

    model.training = True  # type: ignore[attr-defined]
    one_process = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(
        model=model, accelerator=one_process, aux_loss_enabled=False, precompute_ref_logps=True, calculate_KL=True,
        loss_type="kto", beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
    )
    trainer._compute_kl_logps = lambda m, b: kto_trainer.KTOTrainer._compute_kl_logps(trainer, m, b)
    inputs = {
        "input_ids": input_ids, "attention_mask": completion_mask.clamp(min=1), "completion_mask": completion_mask,
        "KL_input_ids": kl_input_ids, "KL_attention_mask": kl_completion_mask.clamp(min=1),
        "KL_completion_mask": kl_completion_mask, "label": labels_B, "ref_logps": ref_B, "ref_KL_logps": ref_kl_B,
    }
    return kto_trainer.KTOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)


def ours(batch, leaf, beta, desirable_weight, undesirable_weight):
    lengths_B, _, labels_B, kl_lengths_B, kl_logps_N, ref_B, ref_kl_B = batch
    kl_B = Ragged.from_lengths(kl_logps_N, kl_lengths_B).sum_per_seq()
    desirable = float(labels_B.sum())
    extras = {
        "global_examples": float(len(labels_B)), "global_desirable": desirable,
        "global_undesirable": float(len(labels_B)) - desirable, "kl": kto_reference_kl(kl_B, ref_kl_B),
        "ref_logps": ref_B, "desirable": labels_B,
    }
    output = SimpleNamespace(policy_logps=lambda: Ragged.from_lengths(leaf, lengths_B))
    loss, _ = make_kto_loss(beta, desirable_weight, undesirable_weight)(output, SimpleNamespace(extras=extras))
    return loss


@pytest.mark.parametrize("beta, desirable_weight, undesirable_weight", [(0.1, 1.0, 1.0), (0.5, 1.0, 1.33), (2.0, 0.7, 1.0)])
@pytest.mark.parametrize("seed", range(3))
def test_kto_equals_trls_kto_loss(beta, desirable_weight, undesirable_weight, seed):
    batch = random_batch(seed)
    logps_N = batch[1]
    theirs_leaf = logps_N.clone().requires_grad_(True)
    want = trl_kto(batch, theirs_leaf, beta, desirable_weight, undesirable_weight)
    want.backward()
    leaf = logps_N.clone().requires_grad_(True)
    got = ours(batch, leaf, beta, desirable_weight, undesirable_weight)
    got.backward()
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(leaf.grad, theirs_leaf.grad, rtol=1e-5, atol=1e-7)
