"""Token-budget micro-batches and seeded mini-batches."""

import time

import pytest
import torch

from turnrl.train.batching import SMALL_COPY_BYTES, Rows, micro_batches, mini_batches, to_device


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


def test_packed_micro_batches_count_real_tokens_first_fit():
    lengths = torch.tensor([300, 10, 250, 120, 90, 300])
    groups = micro_batches(torch.arange(6), lengths, token_budget=400, packed=True)
    assert sorted(int(i) for rows, _ in groups for i in rows) == list(range(6))
    for rows, width in groups:
        assert int(lengths[rows].sum()) <= 400 and width == int(lengths[rows].max())
    # longest first, each row into the first micro-batch with room: 300+90+10, 300, 250+120
    assert [sorted(lengths[rows].tolist()) for rows, _ in groups] == [[10, 90, 300], [300], [120, 250]]
    padded = micro_batches(torch.arange(6), lengths, token_budget=400)
    assert len(groups) < len(padded)


def test_to_device_keeps_values():
    index = torch.tensor([3, 1, 2])
    assert to_device(index, torch.device("cpu")).tolist() == [3, 1, 2]


def test_batch_rows_gives_each_trajectory_one_group_validity_and_reward():
    from turnrl.ledger import Source, Trajectory
    from turnrl.train.metrics import batch_rows
    trajs = []
    for i, group in enumerate(["b", "a", "b", "c"]):
        t = Trajectory(group, i, [])
        t.segment.append([1, 2], Source.PROMPT, 0)
        t.segment.append([3 + i], Source.POLICY, 0, [-0.5])
        t.reward = float(i)
        trajs.append(t)
    trajs[2].mask("the tool crashed")
    rows, valid, rewards, groups = batch_rows(trajs, False, 0, torch.device("cpu"))
    assert groups.tolist() == [0, 1, 0, 2] and valid.tolist() == [True, True, False, True]
    assert rewards.tolist() == [0.0, 1.0, 2.0, 3.0] and rows.traj_index.tolist() == [0, 1, 2, 3]
    assert rows.loss_mask[2].sum() == 0 and rows.engine_logprobs[:, 2].tolist() == [-0.5] * 4
    mb = rows.select(torch.tensor([1, 3]), width=2)   # row metadata follows the rows, [B] tensors uncut
    assert mb.input_ids.shape == (2, 2) and mb.traj_index.tolist() == [1, 3]


def _rows(attention: list[list[int]], loss: list[list[float]]) -> Rows:
    attention_mask, loss_mask = torch.tensor(attention), torch.tensor(loss)
    zeros = torch.zeros_like(loss_mask)
    return Rows(attention_mask * 7, attention_mask, torch.cumsum(attention_mask, 1) - 1, loss_mask, zeros, zeros,
                zeros)


def test_host_counts_come_with_the_rows_and_give_the_loss_normalizers():
    rows = _rows([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], [[0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 1, 0.5]])
    moved = rows.to(torch.device("cpu"))
    counts = moved.host()
    assert counts is moved.host()                       # counted once, kept
    assert counts.attention_mask is moved.attention_mask and counts.loss_mask is moved.loss_mask
    assert counts.lengths.tolist() == moved.lengths.tolist() == [3, 2, 4]
    assert counts.lengths.device.type == "cpu" and counts.lengths.dtype == torch.long
    assert counts.tokens.tolist() == [2.0, 0.0, 1.5]
    assert counts.selected.tolist() == [2, 0, 2] and counts.selected_in(torch.tensor([0, 2])) == 4
    everyone = torch.tensor([0, 1, 2])
    assert counts.normalizer(everyone, seq_mode=False) == float(moved.loss_mask.sum()) == 3.5
    assert counts.normalizer(everyone, seq_mode=True) == 2.0   # rows with any policy token
    assert counts.normalizer(torch.tensor([1]), seq_mode=False) == 0.0


def test_host_counts_are_counted_again_when_a_mask_is_set_anew():
    rows = _rows([[1, 1, 0]], [[0, 1, 0]])
    assert rows.host().tokens.tolist() == [1.0]
    rows.loss_mask = torch.tensor([[0.0, 1.0, 1.0]])
    assert rows.host().tokens.tolist() == [2.0]
    assert rows.select(torch.tensor([0])).host().tokens.tolist() == [2.0]   # a slice counts its own


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("size", [64, 4 * SMALL_COPY_BYTES])   # from pageable memory, through pinned memory
def test_to_device_does_not_wait_for_the_gpus_queue(size):
    cuda = torch.device("cuda")
    host = torch.arange(size // 8, dtype=torch.long)
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)          # ~0.2 s of queued GPU work
    start = time.perf_counter()
    out = to_device(host, cuda)
    waited = time.perf_counter() - start
    torch.cuda.synchronize()
    assert waited < 0.05 and torch.equal(out.cpu(), host)
