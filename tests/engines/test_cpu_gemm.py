"""The skinny CPU kernel for decode-step products: linear's results within float32 rounding, each row's result
independent of the batch, linear itself for what the kernel does not take, a clear reason where it cannot build."""

import pytest
import torch
import torch.nn.functional as F

from turnrl.engines import cpu_gemm


@pytest.fixture(scope="module")
def kernel():
    k, why = cpu_gemm.load()
    if k is None:
        pytest.skip(f"the kernel does not build here: {why}")
    return k


@pytest.mark.parametrize("rows", range(1, cpu_gemm.MAX_ROWS + 1))
@pytest.mark.parametrize("out_in", [(576, 576), (193, 576), (37, 100), (5, 7)])  # odd rows of W; k not a vector
def test_matches_linear(kernel, rows, out_in):
    torch.manual_seed(rows)
    n, k = out_in
    x, w, b = torch.randn(rows, k), torch.randn(n, k) / k ** 0.5, torch.randn(n)
    for bias in (None, b):
        got, want = kernel(x, w, bias), F.linear(x, w, bias)
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_row_s_result_does_not_depend_on_the_batch(kernel):
    torch.manual_seed(0)
    x, w = torch.randn(16, 576), torch.randn(1536, 576)
    alone = torch.cat([kernel(x[i:i + 1], w) for i in range(16)])
    for rows in (2, 7, 16):
        assert torch.equal(kernel(x[:rows], w), alone[:rows])


def test_keeps_leading_dimensions_and_takes_strided_rows(kernel):
    torch.manual_seed(0)
    x, w = torch.randn(8, 2, 64), torch.randn(48, 64)
    rows = x[:, 0]                                  # not contiguous
    torch.testing.assert_close(kernel(rows, w), F.linear(rows, w), rtol=1e-5, atol=1e-5)
    three = torch.randn(3, 1, 64)
    assert kernel(three, w).shape == (3, 1, 48)


def test_linear_for_what_the_kernel_does_not_take(kernel, monkeypatch):
    calls = []
    monkeypatch.setattr(kernel, "_call", lambda *a: calls.append(a))
    torch.manual_seed(0)
    w = torch.randn(32, 64)
    cases = [torch.randn(17, 64),                                  # more rows than MAX_ROWS
             torch.randn(4, 64, dtype=torch.bfloat16),              # not float32
             torch.randn(4, 64, requires_grad=True)]                # autograd wants linear's graph
    for x in cases:
        want = F.linear(x, w.to(x.dtype))
        assert torch.equal(kernel(x, w.to(x.dtype)), want)
    x = torch.randn(4, 64)
    assert torch.equal(kernel(x, w.t().contiguous().t()), F.linear(x, w))   # a weight view that is not contiguous
    assert calls == []


def load_with(compiler, monkeypatch, home):
    """`load()` afresh with `compiler` as $CXX and kernels under `home`; the cache is cleared either way."""
    monkeypatch.setenv("TURNRL_HOME", str(home))
    monkeypatch.setenv("CXX", str(compiler))
    cpu_gemm.load.cache_clear()
    try:
        return cpu_gemm.load()
    finally:
        cpu_gemm.load.cache_clear()


def test_no_compiler_is_a_reason_not_an_error(monkeypatch, tmp_path):
    kernel, why = load_with(tmp_path / "no-such-compiler", monkeypatch, tmp_path)
    assert kernel is None and "failed" in why and "no-such-compiler" in why


def test_a_failed_build_says_what_the_compiler_said(monkeypatch, tmp_path):
    fake = tmp_path / "cxx"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho 'fatal: no room' >&2\nexit 3\n")
    fake.chmod(0o755)
    kernel, why = load_with(fake, monkeypatch, tmp_path)
    assert kernel is None and "exited with 3" in why and "no room" in why
    assert not list((tmp_path / "kernels").glob("*.so"))       # nothing half-built is left to be loaded
