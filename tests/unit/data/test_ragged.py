import torch

from rltrain.data.batch import SequenceBatch
from rltrain.data.ragged import Ragged


def test_sum_and_mean_per_sequence_ignore_nothing_and_pad_nothing():
    r = Ragged.from_lengths(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), [3, 0, 1, 2])
    assert r.sum_per_seq().tolist() == [6.0, 0.0, 4.0, 11.0]
    assert r.mean_per_seq().tolist() == [2.0, 0.0, 4.0, 5.5]
    assert len(r) == 4 and r.num_tokens == 6


def test_to_padded_masks_padding_and_never_sums_it():
    r = Ragged.from_lengths(torch.tensor([-1.0, -2.0, -3.0]), [1, 2])
    padded, mask = r.to_padded(pad_value=0.0)
    assert padded.tolist() == [[-1.0, 0.0], [-2.0, -3.0]]
    assert mask.tolist() == [[True, False], [True, True]]
    assert (padded * mask).sum(1).tolist() == r.sum_per_seq().tolist()


def test_cat_select_broadcast_roundtrip():
    a = Ragged.from_list([torch.tensor([1.0]), torch.tensor([2.0, 3.0])])
    b = Ragged.from_list([torch.tensor([4.0, 5.0, 6.0])])
    c = Ragged.cat([a, b])
    assert c.lengths().tolist() == [1, 2, 3]
    assert c.select([2, 0]).split()[0].tolist() == [4.0, 5.0, 6.0]
    assert c.broadcast(torch.tensor([10.0, 20.0, 30.0])).values.tolist() == [10, 20, 20, 30, 30, 30]


def test_sum_per_seq_is_differentiable():
    v = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    Ragged.from_lengths(v, [2, 1]).sum_per_seq().sum().backward()
    assert v.grad.tolist() == [1.0, 1.0, 1.0]


def test_sequence_batch_select_carries_extras():
    b = SequenceBatch.from_lists([[1], [2, 3]], [[4, 5], [6]], adv=torch.tensor([0.5, -0.5]), scale=3.0)
    s = b.select([1])
    assert s.tokens.values.tolist() == [2, 3, 6]
    assert s.prompt_lens.tolist() == [2]
    assert s.extras["adv"].tolist() == [-0.5] and s.extras["scale"] == 3.0
    assert b.completion_lens().tolist() == [2, 1]
