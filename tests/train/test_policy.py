"""Padded rows in `forward_logprobs`: the padding's positions, and logprobs equal to each row run alone."""

import pytest
import torch

from turnrl.bench.train import model_directory, synthetic_rows
from turnrl.train.policy import continued_positions, forward_logprobs, load_policy


def test_padding_positions_continue_the_row():
    positions = torch.tensor([[0, 1, 2, 0, 0], [0, 1, 2, 3, 4], [5, 6, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    assert continued_positions(positions, mask).tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


@pytest.mark.parametrize("fused_head", [False, True])
def test_right_padded_rows_match_each_row_alone(fused_head):
    torch.manual_seed(0)
    with model_directory("tiny-shape") as path:
        model = load_policy(str(path), torch.device("cpu"))
    rows = synthetic_rows(4, 40, 1024, torch.device("cpu"), seed=5, group=2)
    select = rows.loss_mask > 0
    lp, _ = forward_logprobs(model, rows.input_ids, rows.attention_mask, rows.position_ids,
                             fused_head=fused_head, select=select)
    for row, n in enumerate(rows.lengths.tolist()):
        alone, _ = forward_logprobs(model, rows.input_ids[row:row + 1, :n], rows.attention_mask[row:row + 1, :n],
                                    rows.position_ids[row:row + 1, :n], fused_head=fused_head,
                                    select=select[row:row + 1, :n])
        keep = select[row, :n]
        torch.testing.assert_close(lp[row, :n][keep], alone[0][keep], rtol=0, atol=1e-5)


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_is_bf16_only_where_the_cpu_multiplies_it_natively(native, monkeypatch):
    """On an AVX2-only CPU torch's bf16 GEMM is a scalar fallback (measured on such a machine: 2.7 s for a
    1024^3 product and its backward, against 0.04 s in float32), so `auto` means float32 there for the trainer's
    autocast and the hf engine alike; an explicit bfloat16 is still honoured."""
    import torch

    from turnrl.engines.hf import resolve_dtype
    from turnrl.train.policy import autocast_dtype
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    cpu = torch.device("cpu")
    assert autocast_dtype("auto", cpu) == (torch.bfloat16 if native else None)
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
    assert autocast_dtype("bfloat16", cpu) == torch.bfloat16 and autocast_dtype("float32", cpu) is None
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
