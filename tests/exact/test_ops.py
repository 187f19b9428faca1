"""The batch-invariant ops: a row's result is the same bits alone, inside a larger call, at another place."""

import pytest
import torch

from turnrl.exact import ops

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_do_not_depend_on_the_batch(device, dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(384, 96, generator=g).to(device, dtype)
    x = torch.randn(300, 96, generator=g).to(device, dtype)
    full = ops.linear(x, w)
    for rows in (slice(7, 8), slice(0, 5), slice(100, 263)):
        assert torch.equal(ops.linear(x[rows], w), full[rows])
    assert torch.allclose(full.float(), (x.float() @ w.float().T), atol=0.5 if dtype == torch.bfloat16 else 1e-4)


def test_tree_sum_ignores_trailing_zeros_and_matches_sum():
    x = torch.randn(5, 37, dtype=torch.float64)
    padded = torch.cat([x, torch.zeros(5, 90, dtype=torch.float64)], dim=1)
    assert torch.equal(ops.tree_sum(x), ops.tree_sum(padded))
    assert torch.allclose(ops.tree_sum(x), x.sum(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tree_sum_kernel_is_the_plain_tree_bit_for_bit():
    """On CUDA `tree_sum` is one Triton kernel (`triton_tree`): the same bits as the level-by-level tree, for a
    row alone or among many, and the plain gradient."""
    from turnrl.exact import triton_tree
    if not triton_tree.usable(torch.zeros(1, 4, device="cuda")):
        pytest.skip("Triton is not installed")
    g = torch.Generator().manual_seed(2)
    for n in (1, 2, 3, 37, 64, 896, 1024, 4096):
        x = (torch.randn(300, n, generator=g) * torch.logspace(-30, 30, n)).to("cuda")
        plain = ops.tree_levels(x)[-1][..., 0]
        fused = ops.tree_sum(x)
        assert torch.equal(fused, plain), n
        assert torch.equal(ops.tree_sum(x[7:8]), plain[7:8]) and torch.equal(ops.tree_sum(x[5:263]), plain[5:263])
    y = torch.randn(3, 8, 5, generator=g).to("cuda")
    assert torch.equal(ops.tree_sum(y, -2), ops.tree_levels(y.movedim(-2, -1))[-1][..., 0])
    w = torch.randn(4, 896, generator=g).to("cuda").requires_grad_()
    (ops.tree_sum(w) * torch.arange(4.0, device="cuda")).sum().backward()
    assert torch.equal(w.grad, torch.arange(4.0, device="cuda")[:, None].expand(4, 896))


@pytest.mark.parametrize("device", DEVICES)
def test_attention_query_is_the_same_in_prefill_decode_and_a_longer_cache(device):
    g = torch.Generator().manual_seed(1)
    r, kv, group, d, t = 3, 2, 3, 16, 150
    q = torch.randn(r, kv, t * group, d, generator=g).to(device, torch.bfloat16)
    k = torch.randn(r, kv, 192, d, generator=g).to(device, torch.bfloat16)
    v = torch.randn(r, kv, 192, d, generator=g).to(device, torch.bfloat16)
    qpos = torch.arange(t, device=device).repeat_interleave(group).expand(r, -1)
    full = ops.attention(q, k, v, qpos, 0.25)
    # decode: the queries of position 100 of row 1 alone, over a cache of another length (stale keys past it)
    pos = 100
    sl = slice(pos * group, (pos + 1) * group)
    longer = torch.cat([k[1:2], torch.randn(1, kv, 64, d, generator=g).to(device, torch.bfloat16)], dim=2)
    vlonger = torch.cat([v[1:2], torch.randn(1, kv, 64, d, generator=g).to(device, torch.bfloat16)], dim=2)
    one = ops.attention(q[1:2, :, sl], longer, vlonger, qpos[1:2, sl], 0.25)
    assert torch.equal(one, full[1:2, :, sl])
    short = ops.attention(q[1:2, :, sl], k[1:2, :, :128], v[1:2, :, :128], qpos[1:2, sl], 0.25)
    assert torch.equal(short, full[1:2, :, sl])
    # and it is attention: against a plain causal softmax
    s = (q.float() @ k.float().transpose(-1, -2)) * 0.25
    s = s.masked_fill(torch.arange(192, device=device)[None, None, None] > qpos[:, None, :, None], float("-inf"))
    ref = torch.softmax(s, -1) @ v.float()
    assert torch.allclose(full.float(), ref, atol=2e-2)


def test_attention_and_linear_gradients_are_the_plain_ones():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 1, 8, 16, generator=g, requires_grad=True)
    k = torch.randn(1, 1, 64, 16, generator=g, requires_grad=True)
    v = torch.randn(1, 1, 64, 16, generator=g, requires_grad=True)
    qpos = torch.arange(8)[None]
    ops.attention(q, k, v, qpos, 0.25).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    s = (q @ k.transpose(-1, -2) * 0.25).masked_fill(torch.arange(64)[None] > qpos[0][:, None], float("-inf"))
    (torch.softmax(s, -1) @ v).sum().backward()
    for a, t in zip(got, (q, k, v)):
        assert torch.allclose(a, t.grad, atol=1e-5)


def test_head_logprobs_match_log_softmax_and_its_gradient():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(40, 32, generator=g, requires_grad=True)
    w = torch.randn(1000, 32, generator=g, requires_grad=True)
    labels = torch.randint(0, 1000, (40,), generator=g)
    lp, ent = ops.head_logprobs(h, w, labels, 0.7, chunk=16)
    ref = torch.log_softmax((h @ w.T) / 0.7, -1)
    assert torch.allclose(lp, ref.gather(1, labels[:, None])[:, 0], atol=1e-4)
    assert torch.allclose(ent, -(ref.exp() * ref).sum(-1), atol=1e-3)
    lp.sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref.gather(1, labels[:, None]).sum().backward()
    assert torch.allclose(gh, h.grad, atol=1e-4) and torch.allclose(gw, w.grad, atol=1e-4)


def test_attention_kernel_query_is_the_same_in_prefill_decode_and_a_longer_cache(interpreted):
    """The CUDA attention kernel (here under Triton's interpreter, float16: the interpreter's bf16 dots are
    wrong, so it widens them): a query's bits alone, inside a prefill tile and over longer or shorter caches."""
    from turnrl.exact import triton_ops
    g = torch.Generator().manual_seed(1)
    r, kv, group, d, t = 2, 2, 3, 16, 150
    q, k, v = (torch.randn(r, kv, n, d, generator=g).half() for n in (t * group, 192, 192))
    qpos = torch.arange(t).repeat_interleave(group).expand(r, -1)

    def attend(*args):
        return triton_ops.attention(*args, 0.25, ops.KEY_BLOCK, ops.QUERY_TILE)
    full = attend(q, k, v, qpos)
    sl = slice(100 * group, 101 * group)
    stale = torch.randn(1, kv, 64, d, generator=g).half()
    longer = attend(q[1:2, :, sl], torch.cat([k[1:2], stale], 2), torch.cat([v[1:2], stale], 2), qpos[1:2, sl])
    assert torch.equal(longer, full[1:2, :, sl])
    assert torch.equal(attend(q[1:2, :, sl], k[1:2, :, :128], v[1:2, :, :128], qpos[1:2, sl]), full[1:2, :, sl])
    s = (q.float() @ k.float().transpose(-1, -2)) * 0.25
    s = s.masked_fill(torch.arange(192)[None, None, None] > qpos[:, None, :, None], float("-inf"))
    assert torch.allclose(full.float(), torch.softmax(s, -1) @ v.float(), atol=2e-3)


def test_rms_norm_kernel_rows_do_not_depend_on_the_batch(interpreted):
    from turnrl.exact import triton_ops
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(37, 896, generator=g).half(), torch.randn(896, generator=g).half()
    y = triton_ops._rms_launch(x, w, 1e-6)
    assert torch.equal(triton_ops._rms_launch(x[20:21], w, 1e-6), y[20:21])
    assert torch.allclose(y.float(), triton_ops.plain_rms_norm(x, w, 1e-6).float(), atol=1e-2)


def test_matmul_kernel_rows_do_not_depend_on_the_batch(interpreted):
    """The Triton GEMM (CUDA bf16/fp16 `ops.linear`) under the interpreter: a row alone, in a few rows or in
    a call of many gives the same bits (K and N not multiples of the blocks: masked tails)."""
    from turnrl.exact import triton_ops
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(150, 96, generator=g).half(), torch.randn(200, 96, generator=g).half()
    full = triton_ops.matmul(x, w)
    for rows in (slice(7, 8), slice(0, 5), slice(60, 150)):
        assert torch.equal(triton_ops.matmul(x[rows], w), full[rows])
    assert torch.allclose(full.float(), x.float() @ w.float().T, atol=2e-2, rtol=1e-3)


def test_vocab_tree_kernel_is_the_plain_tree_and_its_search(interpreted):
    """The head's vocabulary kernel under the interpreter: the level it writes is the plain tree's level over
    its leaves, bit for bit; rebuilding a group's bottom levels finds the leaf the full tree finds; a row's
    result does not depend on the other rows."""
    from turnrl.exact import triton_tree
    g = torch.Generator().manual_seed(7)
    vocab = 9000   # P = 16384 = W 4096 x 4 members, 3 levels below
    logits = torch.randn(6, vocab, generator=g) * 4
    temp = torch.tensor([[1.0], [0.7], [1.3], [1.0], [0.5], [2.0]])
    top = logits.amax(-1, keepdim=True) / temp
    leaves, level = triton_tree.vocab_tree(logits, temp.squeeze(1), top.squeeze(1))
    width, below = triton_tree.vocab_split(vocab)
    assert (width, below) == (4096, 2) and level.shape == (6, 4096)
    assert torch.allclose(leaves, torch.exp(logits / temp - top), rtol=1e-5)
    full = ops.tree_levels(leaves)
    assert torch.equal(level, full[below])
    tree = ops.SoftmaxTree(logits, temp, top.squeeze(1), leaves, ops.tree_levels(level), below)
    plain = ops.SoftmaxTree(logits, temp, top.squeeze(1), leaves, full, 0)
    target = torch.rand(6, generator=g) * tree.total
    assert torch.equal(ops.tree_search(tree, target), ops.tree_search(plain, target))
    one, one_level = triton_tree.vocab_tree(logits[2:3], temp[2], top[2])
    assert torch.equal(one, leaves[2:3]) and torch.equal(one_level, level[2:3])


def test_tree_search_lands_where_the_cumulative_weight_passes_the_target():
    g = torch.Generator().manual_seed(8)
    weights = torch.rand(4, 37, generator=g, dtype=torch.float64)
    logits = weights.log()
    tree = ops.softmax_tree(logits, torch.ones(4, 1, dtype=torch.float64))
    target = torch.rand(4, generator=g, dtype=torch.float64) * tree.total
    found = ops.tree_search(tree, target)
    # the tree pairs leaf i with i + P / 2 first, so its left subtree holds the even leaves: its leaf order is
    # the bit-reversed one (padding zeros included, P = 64)
    order = torch.tensor(sorted(range(64), key=lambda i: int(f"{i:06b}"[::-1], 2)))
    padded = torch.cat([tree.leaves, tree.leaves.new_zeros(4, 64 - 37)], dim=1)[:, order]
    passed = (torch.cumsum(padded, -1) <= target[:, None]).sum(-1)   # leaves whose running sum stays below
    assert torch.equal(found, order[passed])


def test_elementwise_kernels_are_the_plain_functions(interpreted):
    from turnrl.exact import triton_ops
    g = torch.Generator().manual_seed(9)
    gate_up = torch.randn(5, 7, 2 * 300, generator=g).half()
    gate, up = gate_up.chunk(2, dim=-1)
    fused = triton_ops.silu_mul(gate, up)
    assert torch.allclose(fused.float(), ops.plain_silu_mul(gate, up).float(), atol=2e-3, rtol=2e-3)
    assert torch.equal(triton_ops.silu_mul(gate[2:3], up[2:3]), fused[2:3])
    qkv = torch.randn(3, 11, 6 * 64, generator=g).half()
    q = qkv[..., :4 * 64].reshape(3, 11, 4, 64)           # a strided view, as the engine's q is
    angles = torch.randn(11, 64, generator=g)
    cos, sin = angles.cos().half()[None, :, None], angles.sin().half()[None, :, None]
    rotated = triton_ops.rope(q, cos, sin)
    assert torch.allclose(rotated.float(), ops.plain_rope(q, cos, sin).float(), atol=4e-3, rtol=4e-3)
    assert torch.equal(triton_ops.rope(q[1:2, 4:9], cos[:, 4:9], sin[:, 4:9]), rotated[1:2, 4:9])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_linear_is_batch_invariant_from_one_row_to_a_prefill():
    """On the GPU: a decode-sized call, a single row and a 5000-row prefill give the same bits per row, at
    the 0.5B model's shapes (qkv, MLP down, a vocabulary-wide head)."""
    g = torch.Generator().manual_seed(6)
    for n, k in ((1152, 896), (896, 4864), (151936, 896)):
        w = (torch.randn(n, k, generator=g) * 0.05).to("cuda", torch.bfloat16)
        x = torch.randn(5000 if n < 100000 else 700, k, generator=g).to("cuda", torch.bfloat16)
        full = ops.linear(x, w)
        for rows in (slice(3, 4), slice(0, 256), slice(300, 557), slice(x.shape[0] - 1, None)):
            assert torch.equal(ops.linear(x[rows], w), full[rows]), (n, k, rows)
        assert torch.allclose(full.float(), x.float() @ w.float().T, atol=0.1, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rms_norm_is_batch_invariant_and_has_the_plain_gradient():
    from turnrl.exact import triton_ops
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, 896, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(896, generator=g).to("cuda", torch.bfloat16)
    assert triton_ops.rms_usable(x, w)
    y = ops.rms_norm(x, w, 1e-6)
    assert torch.equal(ops.rms_norm(x[7:8], w, 1e-6), y[7:8]) and torch.equal(ops.rms_norm(x[5:263], w, 1e-6), y[5:263])
    assert torch.allclose(y.float(), triton_ops.plain_rms_norm(x, w, 1e-6).float(), atol=3e-2)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    ops.rms_norm(xg, wg, 1e-6).float().sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    triton_ops.plain_rms_norm(xr, wr, 1e-6).float().sum().backward()
    assert torch.equal(xg.grad, xr.grad) and torch.equal(wg.grad, wr.grad)
