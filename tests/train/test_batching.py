"""Token-budget micro-batches and seeded mini-batches."""

import torch

from turnrl.train.batching import micro_batches, mini_batches


def test_micro_batches_respect_the_budget_and_cover_every_row():
    lengths = torch.tensor([10, 300, 40, 40, 120, 5, 300])
    groups = micro_batches(torch.arange(7), lengths, token_budget=400)
    seen = sorted(int(i) for rows, _ in groups for i in rows)
    assert seen == list(range(7))
    for rows, width in groups:
        assert width == int(lengths[rows].max())
        assert len(rows) * width <= 400 or len(rows) == 1
    # longest first: the two 300-token rows cannot share (600 > 400)
    assert [int(lengths[rows[0]]) for rows, _ in groups][:2] == [300, 300]


def test_a_row_longer_than_the_budget_gets_its_own_micro_batch():
    groups = micro_batches(torch.arange(3), torch.tensor([900, 10, 10]), token_budget=100)
    assert [len(r) for r, _ in groups] == [1, 2]


def test_mini_batches_are_a_seeded_partition():
    a = mini_batches(10, 3, torch.Generator().manual_seed(1))
    b = mini_batches(10, 3, torch.Generator().manual_seed(1))
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert sorted(int(i) for part in a for i in part) == list(range(10))
    assert len(a) == 3
