"""Linears that read one input, as one GEMM: a graph pass for the compiled decoder layers (`trainer.compile`).

A decoder layer projects one normalised input three times for attention (q, k, v) and twice for a SwiGLU MLP
(gate, up); LoRA adds a rank-r A matrix beside each. Run one by one, each projection is its own GEMM and, in
the backward, each writes its own input gradient, which autograd then sums: with Qwen2.5-0.5B's shapes that
is three [tokens, 896] gradients for q, k, v (two of them from 128-wide GEMMs that run far below the GPU's
rate) and two for gate and up, every one written and read again.

`FuseParallelLinears` rewrites the layer's captured graph (inductor's pre-grad pass, before autograd) so that
every group of `linear(x, w_i, b_i)` on the same `x` becomes `linear(x, cat(w_i), cat(b_i))` split back along
the last dimension. Autograd then sees one GEMM forward, one for the input gradient (the sum over the group
happens inside it) and one for the weight gradient, which `cat`'s backward slices into each weight's. The
weights stay separate parameters (names, checkpoints, weight sync and LoRA targets are unchanged); the `cat`
copies them once per forward (a few MB a layer). The sums run in another order than the separate GEMMs', so
results agree to rounding, not bit for bit.

Measured on an H100 (2026-12-07, `benchmarks/results/h100_train_call_f_*`, the bench's Qwen2.5-0.5B update): the
GEMMs got 4.5 ms faster and the norms' backward 3.7 ms, but the backward's `cat` of the group's output gradients
fused into the SiLU backward and the rotary backward, and those kernels grew by 8.4 and 9.6 ms: 10 ms slower in
all. So `trainer.fuse_linears` is off by default.

A group is fused only when it is plain: two or more 2-d weights of one dtype and input width, biases on all of
them or none, weights defined before the group's first linear, and no user of an output that mutates it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, Node

_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)


def _operands(node: Node) -> tuple[Any, Any, Any]:
    """(input, weight, bias) of a linear call, wherever they were passed."""
    args = list(node.args) + [None] * (3 - len(node.args))
    x = args[0] if args[0] is not None else node.kwargs.get("input")
    w = args[1] if args[1] is not None else node.kwargs.get("weight")
    b = args[2] if args[2] is not None else node.kwargs.get("bias")
    return x, w, b


def _example(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, Node) else None


def _mutates(node: Node) -> bool:
    """Whether a user of `node` changes it in place (an in-place method or op, e.g. add_)."""
    for user in node.users:
        target = user.target
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
        if name.endswith("_") and not name.endswith("__"):
            return True
    return False


def _fusable(nodes: list[Node], order: dict[Node, int]) -> bool:
    first = min(order[n] for n in nodes)
    widths, dtypes = set(), set()
    for node in nodes:
        _, w, b = _operands(node)
        weight = _example(w)
        if weight is None or weight.dim() != 2 or _mutates(node):
            return False
        if order.get(w, first) >= first or (b is not None and order.get(b, first) >= first):
            return False            # a weight computed after the group starts: leave the group alone
        if b is not None and (_example(b) is None or _example(b).dim() != 1):
            return False
        widths.add(weight.shape[1])
        dtypes.add(weight.dtype)
    return len(widths) == 1 and len(dtypes) == 1


def fuse_parallel_linears(graph: Graph) -> int:
    """Rewrite `graph` in place: each plain group of linears on one input becomes one linear and a split.
    Returns the number of groups fused."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups: dict[tuple[Node, bool], list[Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _LINEAR:
            x, w, b = _operands(node)
            if isinstance(x, Node) and isinstance(w, Node) and (b is None or isinstance(b, Node)):
                groups.setdefault((x, b is None), []).append(node)
    fused = 0
    for (x, no_bias), nodes in groups.items():
        if len(nodes) < 2 or not _fusable(nodes, order):
            continue
        nodes.sort(key=order.__getitem__)
        weights = [_operands(n)[1] for n in nodes]
        sizes = [int(_example(w).shape[0]) for w in weights]
        with graph.inserting_before(nodes[0]):
            weight = graph.call_function(torch.cat, (weights,), {"dim": 0})
            bias = None if no_bias else graph.call_function(torch.cat, ([_operands(n)[2] for n in nodes],),
                                                            {"dim": 0})
            out = graph.call_function(torch._C._nn.linear, (x, weight, bias))
            parts = graph.call_function(torch.split, (out, sizes), {"dim": -1})
            for i, node in enumerate(nodes):
                part = graph.call_function(operator.getitem, (parts, i))
                part.meta.update(node.meta)
                node.replace_all_uses_with(part)
        for node in nodes:
            graph.erase_node(node)
        fused += 1
    if fused:
        graph.lint()
    FuseParallelLinears.fused += fused
    return fused


class FuseParallelLinears(CustomGraphPass):
    """`fuse_parallel_linears` as inductor's `pre_grad_custom_pass` (cacheable: its uuid hashes this file).
    `fused` counts the groups fused by every instance (tests and reports read it)."""

    fused = 0

    def __call__(self, graph: Graph) -> None:
        fuse_parallel_linears(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
