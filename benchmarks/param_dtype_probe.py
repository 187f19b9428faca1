"""What bf16 parameters would save the update against fp32 parameters under bf16 autocast (the trainer's way).

    python benchmarks/param_dtype_probe.py --arm fp32-autocast|bf16-params -- [turnrl bench train arguments]

`bf16-params` casts the loaded policy to bf16 before `turnrl bench train` compiles it and builds its
optimizer: the forward, backward and AdamW all run on bf16 tensors, so the residual stream, the norms' inputs
and outputs and the weight gradients are bf16 (FSDP's `param_dtype=bf16` computes this way; it keeps fp32
master weights in the optimizer, which this probe does not, so its AdamW time is low by the fp32 copy). It is a
measurement of where the update's time would go, not a training mode: compare the two arms' kernel profiles
(`--profile`).
"""

from __future__ import annotations

import sys

import torch

import turnrl.bench.train as bench_train_module
from turnrl.cli import main


def bf16_policy(load):
    def load_bf16(*args, **kwargs):
        return load(*args, **kwargs).to(torch.bfloat16)
    return load_bf16


if __name__ == "__main__":
    argv = sys.argv[1:]
    arm = argv[argv.index("--arm") + 1]
    rest = argv[argv.index("--") + 1:]
    if arm == "bf16-params":
        bench_train_module.load_policy = bf16_policy(bench_train_module.load_policy)
    elif arm != "fp32-autocast":
        raise SystemExit("--arm is fp32-autocast or bf16-params")
    sys.exit(main(["bench", "train", *rest]))
