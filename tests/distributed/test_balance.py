"""Rows dealt to ranks by tokens; every rank gets the same number of micro-batches; the global normalizer."""

import torch

from turnrl.distributed.balance import assign_rows, plan_mini, plan_passes, rank_tokens


def test_rows_are_dealt_by_tokens_not_by_count():
    lengths = torch.tensor([100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10])
    shares = assign_rows(torch.arange(11), lengths, 2)
    loads = sorted(int(lengths[s].sum()) for s in shares)
    assert loads == [100, 100]                       # the long row alone on one rank, the ten short ones on the other
    assert sorted(torch.cat(shares).tolist()) == list(range(11))


def test_lpt_keeps_every_rank_within_one_row_of_the_mean():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 300, (64,), generator=g)
    for ranks in (1, 2, 3, 8):
        loads = [int(lengths[s].sum()) for s in assign_rows(torch.arange(64), lengths, ranks)]
        assert max(loads) - sum(loads) / ranks <= int(lengths.max())


def test_every_rank_runs_the_same_number_of_micro_batches():
    lengths = torch.tensor([40, 40, 40, 40, 3])
    mask = torch.zeros(5, 40)
    for i, n in enumerate(lengths.tolist()):
        mask[i, n // 2:n] = 1
    plan = plan_mini(torch.arange(5), lengths, mask, ranks=2, token_budget=40, seq_mode=False)
    assert len(plan.micro[0]) == len(plan.micro[1])
    assert plan.normalizer == float(mask.sum())       # global, not per rank
    seen = sorted(i for micro in plan.micro for mb in micro if mb is not None for i in mb[0].tolist())
    assert seen == list(range(5))                    # every row exactly once
    assert sum(rank_tokens(plan, lengths)) == int(lengths.sum())
    seq = plan_mini(torch.arange(5), lengths, mask, ranks=2, token_budget=40, seq_mode=True)
    assert seq.normalizer == 5.0


def test_a_rank_without_rows_runs_only_dummies():
    per_rank = plan_passes(torch.tensor([0]), torch.tensor([7]), ranks=3, token_budget=64)
    assert [len(m) for m in per_rank] == [1, 1, 1]
    assert sum(mb is None for m in per_rank for mb in m) == 2
