"""The ranks' weights dtype: trainer.param_dtype as the FSDP2 policy's param_dtype."""

import pytest
import torch

from turnrl.distributed.ranks import rank_param_dtype

CUDA, CPU, BF16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16


def test_gpu_ranks_compute_in_bf16_unless_told_fp32():
    assert rank_param_dtype("auto", BF16, CUDA) == BF16
    assert rank_param_dtype("bfloat16", BF16, CUDA) == BF16
    assert rank_param_dtype("float32", BF16, CUDA) is None      # the fp32 weights under autocast
    assert rank_param_dtype("auto", None, CUDA) is None         # trainer.dtype float32


def test_cpu_ranks_keep_fp32_weights_and_refuse_bf16_ones():
    assert rank_param_dtype("auto", BF16, CPU) is None
    with pytest.raises(ValueError, match="GPU ranks"):
        rank_param_dtype("bfloat16", BF16, CPU)
