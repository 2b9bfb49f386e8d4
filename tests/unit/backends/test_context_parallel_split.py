"""A rectangle's slice per cp rank (rltrain/backends/fsdp/context_parallel/split.py) against hand-built
values: the row padded to a multiple of cp, padding in a document of its own (seen by no real token),
each scored position owned by the rank holding the position that predicts it, and `Positions.local`
taking ragged order to the rank's own positions in the rectangle's order."""

from __future__ import annotations

import torch

from rltrain.backends.fsdp.context_parallel.sequence_split import Positions
from rltrain.backends.fsdp.context_parallel.split import slice_rectangle
from rltrain.backends.fsdp.micro_batches.shared_prefix import Rectangle


def test_a_padding_free_row_of_5_tokens_splits_into_two_slices_of_3():
    ids = torch.tensor([[11, 12, 13, 14, 15]])
    rect = Rectangle(
        ids, rows_N=torch.tensor([0, 0, 0]), cols_N=torch.tensor([0, 2, 3]),
        position_ids_BT=torch.tensor([[0, 1, 0, 1, 2]]), document_ids_BT=torch.tensor([[0, 0, 1, 1, 1]]),
    )
    first, second = (slice_rectangle(rect, r, 2, group=None) for r in (0, 1))  # type: ignore[arg-type]
    assert first.input_ids_BL.tolist() == [[11, 12, 13]] and second.input_ids_BL.tolist() == [[14, 15, 0]]
    assert first.position_ids_BL.tolist() == [[0, 1, 0]] and second.position_ids_BL.tolist() == [[1, 2, 3]]
    mask = first.attention.mask_B1TT[0, 0]
    assert mask.shape == (6, 6)
    assert mask[4].tolist() == [False, False, True, True, True, False]  # token 4 sees its document only
    assert mask[5].tolist() == [False] * 5 + [True]  # the padding sees itself only
    assert first.owner_N.tolist() == [0, 0, 1]
    assert (first.rows_n.tolist(), first.cols_n.tolist()) == ([0, 0], [0, 2])
    assert (second.rows_n.tolist(), second.cols_n.tolist()) == ([0], [0])  # position 3 is column 0 of slice 1


def test_a_plain_rectangle_stays_causal_and_a_dense_mask_is_padded_with_self_attention():
    plain = Rectangle(torch.ones(2, 3, dtype=torch.long), torch.tensor([0, 1]), torch.tensor([2, 1]))
    call = slice_rectangle(plain, 1, 2, group=None)  # type: ignore[arg-type]
    assert call.attention.mask_B1TT is None and call.input_ids_BL.shape == (2, 2)
    dense = Rectangle(
        torch.ones(1, 3, dtype=torch.long), torch.tensor([0]), torch.tensor([2]),
        attention_mask_B1TT=torch.ones(3, 3, dtype=torch.bool).tril()[None, None],
    )
    mask = slice_rectangle(dense, 0, 2, group=None).attention.mask_B1TT  # type: ignore[arg-type, union-attr]
    assert mask[0, 0, 3].tolist() == [False, False, False, True] and not mask[0, 0, :3, 3].any()


def test_local_takes_ragged_order_to_this_ranks_positions_in_rectangle_order():
    # rectangle order [a, b, c, d] is ragged order [c, a, d, b]: ragged[k] = rect[order_N[k]]
    order_N = torch.tensor([2, 0, 3, 1])
    positions = Positions(torch.tensor([0, 1, 1, 0]), order_N, cp_rank=1, size=2, group=None)  # type: ignore[arg-type]
    rect = torch.tensor([10.0, 11.0, 12.0, 13.0])
    assert positions.local(rect[order_N]).tolist() == [11.0, 12.0]
