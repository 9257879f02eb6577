"""How a global batch is cut over workers and micro-batches ([Note: uneven splits] in
zeroray/engine/batch.py): the sizes, the loss weights (exactly 1.0 for an equal split, so that
split's arithmetic is unchanged), and the error for a batch with fewer rows than parts."""
import pytest
import torch

from zeroray.engine.batch import part_weights, split_batch, split_sizes


def test_sizes_are_array_splits():
    assert split_sizes(16, 3) == [6, 5, 5]
    assert split_sizes(16, 2) == [8, 8]
    assert split_sizes(7, 4) == [2, 2, 2, 1]
    assert split_sizes(3, 3) == [1, 1, 1]
    for rows in range(1, 40):
        for parts in range(1, rows + 1):
            sizes = split_sizes(rows, parts)
            assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_split_batch_keeps_every_row_in_order_and_every_structure():
    batch = {"ids": torch.arange(16).reshape(16, 1), "pair": (torch.arange(16), torch.arange(16) * 2)}
    parts = split_batch(batch, 3)
    assert [p["ids"].shape[0] for p in parts] == [6, 5, 5]
    assert torch.equal(torch.cat([p["ids"] for p in parts]), batch["ids"])
    assert all(isinstance(p["pair"], tuple) and torch.equal(p["pair"][1], p["pair"][0] * 2) for p in parts)
    # a worker's share over its micro-batches: 6 -> 3, 3 and 5 -> 3, 2 with 2 micro-batches
    assert [[m["ids"].shape[0] for m in split_batch(p, 2)] for p in parts] == [[3, 3], [3, 2], [3, 2]]


def test_weights_are_the_rows_share_and_exactly_one_when_equal():
    # 16 rows over 3 workers x 1 micro-batch: 6/16 of the batch is 6 * 3 / 16 of an equal part
    assert part_weights([6], 16, 3) == [1.125] and part_weights([5], 16, 3) == [0.9375]
    for rows, world, accum in [(16, 2, 1), (12, 3, 2), (64, 4, 4), (6, 1, 3)]:
        for share in split_sizes(rows, world):
            weights = part_weights(split_sizes(share, accum), rows, world * accum)
            assert all(w == 1.0 for w in weights), (rows, world, accum, weights)
    # the weights of every part of a batch sum to the number of parts: sum_p n_p / N == 1
    micro = [m for s in split_sizes(17, 3) for m in split_sizes(s, 2)]
    assert sum(part_weights(micro, 17, 6)) == pytest.approx(6.0, rel=1e-12)


def test_fewer_rows_than_parts_is_refused():
    with pytest.raises(ValueError, match="has 2 rows, fewer than its 3 parts: each part needs at least one row"):
        split_sizes(2, 3)
    with pytest.raises(ValueError, match="the worker's share has 1 rows, fewer than its 2 parts"):
        split_batch(torch.zeros(1, 4), 2, "worker's share")
