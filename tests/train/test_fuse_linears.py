"""The pass that runs the linears reading one input as one GEMM: on graphs dynamo captures (run eagerly, so the
rewritten graph is checked by itself), and on a real decoder compiled by inductor (`compile_layers`)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from turnrl.train.fuse_linears import FuseParallelLinears, fuse_parallel_linears
from turnrl.train.policy import compile_layers


def capture(module, *inputs):
    """Compile `module` with a backend that applies the pass to dynamo's graph and runs it eagerly; returns
    (compiled module, [linear count after the pass, groups fused])."""
    seen = []

    def backend(gm, example_inputs):
        fused = fuse_parallel_linears(gm.graph)
        gm.recompile()
        linears = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in
                      (torch._C._nn.linear, F.linear))
        seen.append((linears, fused))
        return gm.forward
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    return compiled, seen


class Block(torch.nn.Module):
    """q, k, v with biases on the normed input, gate and up without on another; o on a third input."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def param(*shape):
            return torch.nn.Parameter(torch.randn(*shape, generator=g, dtype=dtype) * 0.1)
        self.wq, self.wk, self.wv = param(16, 8), param(4, 8), param(4, 8)
        self.bq, self.bk, self.bv = param(16), param(4), param(4)
        self.wo = param(8, 16)
        self.wg, self.wu, self.wd = param(12, 8), param(12, 8), param(8, 12)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        q, k, v = F.linear(h, self.wq, self.bq), F.linear(h, self.wk, self.bk), F.linear(h, self.wv, self.bv)
        att = torch.softmax(q[..., :4] @ k.transpose(-1, -2), -1) @ v
        x = x + F.linear(torch.cat([att, q[..., 4:]], -1), self.wo)
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x + F.linear(F.silu(F.linear(h, self.wg)) * F.linear(h, self.wu), self.wd)


def grads(module, out, grad):
    module.zero_grad()
    out.backward(grad)
    return [p.grad.clone() for p in module.parameters()]


def test_linears_on_one_input_become_one_and_compute_the_same():
    block = Block()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    grad = torch.randn(2, 5, 8, dtype=torch.float64)
    want = block(x)
    want_grads = grads(block, want, grad)
    compiled, seen = capture(block, x)
    got = compiled(x)
    # 7 linears: q, k, v -> one; gate, up -> one; o and down stay alone
    assert seen == [(4, 2)]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads(block, got, grad), want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_groups_that_are_not_plain_stay_apart():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.randn(3, 4))
            self.b = torch.nn.Parameter(torch.randn(3, 4))
            self.c = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
            self.bias = torch.nn.Parameter(torch.randn(3))

        def forward(self, x):
            mutated = F.linear(x, self.a)
            mutated.add_(1.0)                                    # an output changed in place: not fused
            other = F.linear(x, self.b)
            xd, y = x.double(), x * 2
            mixed = F.linear(xd, self.c) + F.linear(xd, self.a.double())   # a weight made after the group starts
            biased = F.linear(y, self.a, self.bias) + F.linear(y, self.b)  # a bias on one only
            return mutated.sum() + other.sum() + mixed.sum() + biased.sum()

    module = Odd()
    x = torch.randn(2, 4)
    compiled, seen = capture(module, x)
    torch.testing.assert_close(compiled(x), module(x))
    assert seen == [(6, 0)]


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_compiled_decoder_layers_fuse_and_match_the_unfused_compile(monkeypatch, lora_rank):
    """A real (tiny) Qwen2 loaded as the trainer loads it, through inductor: in every layer graph q/k/v and
    gate/up fuse (with LoRA, their A matrices too); logits and every trainable gradient agree with the same
    layers compiled without the pass (float32: to rounding)."""
    from turnrl.bench.train import model_directory
    from turnrl.train.policy import load_policy
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    torch._dynamo.reset()
    torch.manual_seed(0)
    with model_directory("tiny-shape") as path:
        fused = load_policy(str(path), torch.device("cpu"), lora_rank, 8.0)
    plain = copy.deepcopy(fused)
    before = FuseParallelLinears.fused
    compile_layers(fused, fuse_linears=True)
    compile_layers(plain)
    ids = torch.randint(0, fused.config.vocab_size, (2, 17))
    got, want = fused(input_ids=ids).logits, plain(input_ids=ids).logits
    groups = FuseParallelLinears.fused - before
    per_graph = 4 if lora_rank else 2                # + the A matrices of q/k/v and of gate/up
    assert groups >= per_graph and groups % per_graph == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.square().sum().backward()
    want.square().sum().backward()
    trained = [(n, a, b) for (n, a), (_, b) in zip(fused.named_parameters(), plain.named_parameters())
               if a.requires_grad]
    assert trained
    for name, a, b in trained:
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("fuse", [True, False])
def test_the_config_key_reaches_the_compile(fuse, monkeypatch):
    """trainer.fuse_linears is read, off by default (and an unknown spelling is refused by the loader)."""
    from turnrl.config import ConfigError, load_config
    assert load_config(None, []).trainer.fuse_linears is False
    cfg = load_config(None, [f"trainer.fuse_linears={str(fuse).lower()}"])
    assert cfg.trainer.fuse_linears is fuse
    with pytest.raises(ConfigError):
        load_config(None, ["trainer.fuse_linear=true"])
