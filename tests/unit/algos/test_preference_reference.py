"""The preference losses (DPO's `algo.loss` variants, SimPO, ORPO) against TRL's own loss code on
random ragged batches, equal to fp32 rounding in loss and gradient: `DPOTrainer._compute_loss`,
the experimental `CPOTrainer.get_batch_loss_metrics` (`loss_type="simpo"`, `cpo_alpha=0`: SimPO) and
`ORPOTrainer.get_batch_loss_metrics` of TRL 1.16, each driven through a stub trainer and model (one
process, no reference model: DPO gets precomputed reference log-probabilities). rltrain's side is
the loss closure its algorithm hands the engine, on a ragged batch with chosen and rejected
interleaved; TRL's is its padded layout, chosen rows first. TRL is pinned with the test tools
(requirements/). Hand-computed values:
tests/unit/algos/test_dpo_loss.py and tests/unit/algos/test_reference_free_losses.py.
"""

from __future__ import annotations

import functools
import importlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rltrain.algos.dpo import make_dpo_loss
from rltrain.algos.orpo import make_orpo_loss
from rltrain.algos.simpo import make_simpo_loss
from rltrain.data.ragged import Ragged

MAX_LEN, VOCAB = 9, 11


def random_pairs(seed: int, pairs: int = 5):
    """Completion lengths (1 to MAX_LEN) of each pair's chosen and rejected completion, and their
    token ids: [2P] lengths in rltrain's interleaved order (chosen 2i, rejected 2i+1)."""
    g = torch.Generator().manual_seed(seed)
    lengths_S = torch.randint(1, MAX_LEN + 1, (2 * pairs,), generator=g)
    tokens_N = torch.randint(0, VOCAB, (int(lengths_S.sum()),), generator=g)
    return g, lengths_S, tokens_N


def trl_order(lengths_S, values_N, pad=0.0):
    """[2P, T] rows of the interleaved ragged values, chosen rows first as TRL lays them out, and
    the [2P, T] mask."""
    seqs = torch.split(values_N, lengths_S.tolist())
    order = list(range(0, len(seqs), 2)) + list(range(1, len(seqs), 2))
    rows = torch.nn.utils.rnn.pad_sequence([seqs[i] for i in order], batch_first=True, padding_value=pad)
    lengths = lengths_S[order]
    mask = torch.arange(rows.shape[1])[None, :] < lengths[:, None]
    return rows, mask


def ours(loss_fn, lengths_S, logps_N, extras):
    output = SimpleNamespace(logps=Ragged.from_lengths(logps_N, lengths_S))
    loss, _ = loss_fn(output, SimpleNamespace(extras=extras))
    return loss


def global_extras(lengths_S):
    return {"global_pairs": float(len(lengths_S) // 2), "global_chosen_tokens": float(lengths_S[0::2].sum())}


def one_process():
    return SimpleNamespace(
        device=torch.device("cpu"), num_processes=1, gather=lambda t: t, gather_for_metrics=lambda t: t,
        autocast=torch.autocast, unwrap_model=lambda m: m,
    )


# --- DPO ---------------------------------------------------------------------------------------

DPO_CASES = [("sigmoid", 0.0), ("robust", 0.1), ("robust", 0.3), ("hinge", 0.0), ("ipo", 0.0)]


def trl_dpo(lengths_S, logps_N, ref_c, ref_r, beta, loss, label_smoothing):
    """TRL's `DPOTrainer._compute_loss`: its model's per-token log-probabilities (a fused head's
    `log_probs`, zero off the completion) replaced by `logps_N`; prompts of one token."""
    dpo_trainer = importlib.import_module("trl.trainer.dpo_trainer")
    per_token, mask = trl_order(lengths_S, logps_N)
    rows, width = per_token.shape
    completion_mask = torch.cat([torch.zeros(rows, 1, dtype=torch.long), mask.long()], dim=1)  # prompt, completion

    def model(**kwargs):
        return SimpleNamespace(
            log_probs=per_token, entropy=torch.zeros(rows, width), mean_logits=torch.zeros(rows, width),
            is_top1=torch.zeros(rows, width, dtype=torch.bool),
        )

    model.training = True  # type: ignore[attr-defined]
    trainer = SimpleNamespace(
        model=model, accelerator=one_process(), aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[loss], loss_weights=[1.0], beta=beta,
        label_smoothing=label_smoothing, use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1, args=SimpleNamespace(),
    )
    inputs = {
        "input_ids": torch.zeros(rows, width + 1, dtype=torch.long), "attention_mask": completion_mask.clamp(min=1),
        "completion_mask": completion_mask, "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r,
    }
    return dpo_trainer.DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)


@pytest.mark.parametrize("loss, label_smoothing", DPO_CASES, ids=[f"{c[0]}-{c[1]}" for c in DPO_CASES])
@pytest.mark.parametrize("seed", range(3))
def test_dpo_losses_equal_trls(loss, label_smoothing, seed):
    g, lengths_S, _ = random_pairs(seed)
    logps_N = -torch.rand(int(lengths_S.sum()), generator=g) * 3
    pairs = len(lengths_S) // 2
    ref_c, ref_r = -torch.rand(pairs, generator=g) * 10, -torch.rand(pairs, generator=g) * 10
    beta = 0.3

    theirs_leaf = logps_N.clone().requires_grad_(True)
    want = trl_dpo(lengths_S, theirs_leaf, ref_c, ref_r, beta, loss, label_smoothing)
    want.backward()
    leaf = logps_N.clone().requires_grad_(True)
    extras = {**global_extras(lengths_S), "ref_chosen": ref_c, "ref_rejected": ref_r}
    got = ours(make_dpo_loss(beta, loss, label_smoothing, 0.0), lengths_S, leaf, extras)
    got.backward()
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(leaf.grad, theirs_leaf.grad, rtol=1e-5, atol=1e-7)


# --- SimPO and ORPO: from logits, through TRL's own length-normalised log-probabilities ------------


def logits_and_batch(seed: int):
    """Random logits [2P, T, V] in TRL's layout (one prompt token, then the completion), the batch
    TRL's `concatenated_inputs` reads, and the map to rltrain's ragged per-token log-probabilities."""
    g, lengths_S, tokens_N = random_pairs(seed)
    ids, mask = trl_order(lengths_S, tokens_N, pad=0)
    rows, width = ids.shape
    pairs = rows // 2
    input_ids = torch.cat([torch.full((rows, 1), 1), ids], dim=1)
    attention = torch.cat([torch.ones(rows, 1, dtype=torch.long), mask.long()], dim=1)
    labels = input_ids.masked_fill(attention == 0, -100)
    labels[:, 0] = -100  # the prompt
    logits = torch.randn(rows, width + 1, VOCAB, generator=g) * 2
    batch = {}
    for side, sl in (("chosen", slice(0, pairs)), ("rejected", slice(pairs, rows))):
        batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"] = input_ids[sl], attention[sl]
        batch[f"{side}_labels"] = labels[sl]

    def ragged_logps(leaf):
        """rltrain's per-token log-probabilities: completion token j of a row from position j."""
        logps = torch.log_softmax(leaf[:, :-1], dim=-1).gather(-1, ids[..., None]).squeeze(-1)  # [2P, T]
        per_row = [logps[r, : int(mask[r].sum())] for r in range(rows)]
        interleaved = [per_row[i // 2 + (pairs if i % 2 else 0)] for i in range(rows)]
        return torch.cat(interleaved)

    return lengths_S, logits, batch, ragged_logps


def trl_stub(module, cls, **settings):
    stub = SimpleNamespace(
        accelerator=one_process(), is_encoder_decoder=False, aux_loss_enabled=False, padding_value=0, pad_token_id=0,
        label_pad_token_id=-100, **settings,
    )
    stub.concatenated_inputs = cls.concatenated_inputs
    stub.get_batch_logps = cls.get_batch_logps
    for name in ("concatenated_forward", "odds_ratio_loss", "cpo_loss"):
        if hasattr(cls, name):
            setattr(stub, name, functools.partial(getattr(cls, name), stub))
    return stub


def check_against_trl(seed, trl_module, cls_name, settings, loss_fn):
    module = importlib.import_module(trl_module)
    cls = getattr(module, cls_name)
    lengths_S, logits, batch, ragged_logps = logits_and_batch(seed)
    stub = trl_stub(module, cls, **settings)
    theirs_leaf = logits.clone().requires_grad_(True)
    want, _ = cls.get_batch_loss_metrics(stub, lambda ids, **kw: SimpleNamespace(logits=theirs_leaf), batch)
    want.backward()
    leaf = logits.clone().requires_grad_(True)
    got = ours(loss_fn, lengths_S, ragged_logps(leaf), global_extras(lengths_S))
    got.backward()
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(leaf.grad, theirs_leaf.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("beta, gamma", [(2.0, 1.0), (0.5, 0.0), (2.5, 1.6)])
@pytest.mark.parametrize("seed", range(3))
def test_simpo_equals_trls_cpo_simpo_loss(beta, gamma, seed):
    settings = dict(alpha=0.0, loss_type="simpo", beta=beta, simpo_gamma=gamma, label_smoothing=0.0, cpo_alpha=0.0)
    check_against_trl(seed, "trl.experimental.cpo.cpo_trainer", "CPOTrainer", settings, make_simpo_loss(beta, gamma))


@pytest.mark.parametrize("lambda_", [0.1, 1.0])
@pytest.mark.parametrize("seed", range(3))
def test_orpo_equals_trls_orpo_loss(lambda_, seed):
    """TRL's NLL term counts the prompt's tokens too, rltrain's (as the paper's) the completion's
    only: with one-token prompts the prompt has no predicted token, so the two coincide."""
    settings = dict(beta=lambda_)  # TRL's ORPOConfig.beta is the paper's lambda
    check_against_trl(seed, "trl.experimental.orpo.orpo_trainer", "ORPOTrainer", settings, make_orpo_loss(lambda_))
