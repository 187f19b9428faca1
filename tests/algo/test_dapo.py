import pytest
import torch

from turnrl.algo.dapo import groups_with_signal, overlong_penalty


def test_groups_with_signal_drops_groups_whose_samples_all_score_the_same():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    groups = torch.tensor([7, 7, 3, 3, 9, 9, 4])  # ids need not be contiguous; group 4 has one sample
    assert groups_with_signal(values, groups).tolist() == [False, False, True, True, False, False, True]
    assert groups_with_signal(torch.zeros(0), torch.zeros(0, dtype=torch.long)).tolist() == []
    with pytest.raises(TypeError, match="integer"):
        groups_with_signal(values, groups.float())


def test_overlong_penalty_is_linear_inside_the_buffer():
    lengths = torch.tensor([50, 80, 90, 95, 100, 120])
    # limit 100, buffer 20: no penalty up to 80, then (80 - L) / 20, -1 from 100 on
    assert overlong_penalty(lengths, 100, 20).tolist() == [0.0, 0.0, -0.5, -0.75, -1.0, -1.0]
    assert overlong_penalty(lengths, 100, 20, factor=0.5).tolist() == [0.0, 0.0, -0.25, -0.375, -0.5, -0.5]
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, 100, 0)
