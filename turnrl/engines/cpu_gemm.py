"""A decode step's weight products on the CPU: y = x W^T (+ b) for 1-16 rows of float32, W read once.

A decode step multiplies a few rows (one per running request) by every weight matrix, so its products read
425 MB of weights (SmolLM2-135M's body in float32) for ~1.7 GFLOP at 8 rows. On this project's 2-core Xeon
(AVX-512), PyTorch's `linear` (MKL) streams the weights near the memory bandwidth at one row but at about half of
it from 4 rows on: 26.6 / 30.0 / 37.7 ms for the body's 210 products at 4 / 8 / 16 rows against 15.8 at one
(`python benchmarks/cpu_gemm_probe.py`, benchmarks/results/cpu_gemm_probe_2026-12-06.json). This kernel walks
W's rows once, two at a time, keeps each (row of x, row of W) sum in a vector register, and asks for the rows
two ahead with a prefetch into L2 (without it the weights streamed no faster than MKL's); x stays in L1. Same
products: 18.6 / 20.6 / 26.7 ms (16.7 at one).

Each output is one dot product summed in the same order (vector lanes over k, then the lanes left to right)
whatever the number of rows, so a row's result does not depend on the batch; it differs from MKL's in the
last bits. It is C++ built once per machine with the system compiler (`-O3 -march=native -fopenmp`, a second
or two) into `$TURNRL_HOME/kernels`, named by a hash of its source, flags, compiler and CPU, and called through
ctypes. Its OpenMP is the one PyTorch loaded (PyTorch's wheel ships `libgomp.so.1`, the soname the compiler
links), so its threads are PyTorch's. `load()` returns None and why where there is no compiler, no Linux x86-64,
or the build fails; the callers then keep `linear`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_ROWS = 16
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#define VW 16   /* floats a vector */
#define NR 2    /* rows of W a pass: 2 x M accumulators fit the 32 vector registers */
#else
#define VW 8
#define NR 1
#endif
#define AHEAD 2 /* rows of W prefetched ahead of the one being read */
typedef float vec __attribute__((vector_size(VW * 4)));

template <int M>
static void rows(const float* x, const float* w, const float* b, float* y, int64_t N, int64_t K, int threads) {
  #pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; n += NR) {
    const int nr = (n + NR <= N) ? NR : (int)(N - n);
    vec acc[NR][M];
    for (int j = 0; j < NR; ++j)
      for (int m = 0; m < M; ++m) acc[j][m] = (vec){0};
    int64_t k = 0;
    for (; k + VW <= K; k += VW) {
      vec wv[NR];
      for (int j = 0; j < NR; ++j) {
        const float* wr = w + (n + (j < nr ? j : 0)) * K + k;
        __builtin_prefetch(wr + AHEAD * K, 0, 1);
        memcpy(&wv[j], wr, sizeof(vec));
      }
      for (int m = 0; m < M; ++m) {
        vec xv;
        memcpy(&xv, x + m * K + k, sizeof(vec));
        for (int j = 0; j < NR; ++j) acc[j][m] += wv[j] * xv;
      }
    }
    for (int j = 0; j < nr; ++j) {
      const float* wr = w + (n + j) * K;
      for (int m = 0; m < M; ++m) {
        float s = 0.0f;
        for (int i = 0; i < VW; ++i) s += acc[j][m][i];
        for (int64_t t = k; t < K; ++t) s += x[m * K + t] * wr[t];
        y[m * N + n + j] = b ? s + b[n + j] : s;
      }
    }
  }
}

extern "C" int turnrl_skinny_linear(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
                                    const float* b, float* y, int threads) {
  switch (M) {
#define ROWS(i) case i: rows<i>(x, w, b, y, N, K, threads); return 0;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
    ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
  }
  return 1;
}
"""


class SkinnyLinear:
    """`F.linear` with the kernel for float32 CPU inputs of 1-`MAX_ROWS` rows, contiguous weights; `F.linear`
    for anything else."""

    def __init__(self, library: ctypes.CDLL):
        self._call = library.turnrl_skinny_linear
        self._call.restype = ctypes.c_int
        self._call.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if not 0 < rows <= MAX_ROWS or x.dtype != torch.float32 or weight.dtype != torch.float32 \
                or x.device.type != "cpu" or weight.device.type != "cpu" or not weight.is_contiguous() \
                or weight.shape[1] != k or (bias is not None and (bias.dtype != torch.float32 or
                                                                 not bias.is_contiguous())) \
                or x.requires_grad or weight.requires_grad:
            return F.linear(x, weight, bias)
        x = x.contiguous()
        n = weight.shape[0]
        out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
        self._call(x.data_ptr(), rows, k, weight.data_ptr(), n, 0 if bias is None else bias.data_ptr(),
                   out.data_ptr(), torch.get_num_threads())
        return out


def kernels_dir() -> Path:
    from turnrl.models import turnrl_home
    return turnrl_home() / "kernels"


@functools.cache
def load() -> tuple[SkinnyLinear | None, str]:
    """The kernel, built here on first use; (None, why) where it cannot be."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the kernel is built for Linux x86-64 only, not {platform.system()} {platform.machine()}"
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return None, "no C++ compiler (g++) found: install one (apt-get install g++) to build the decode kernel"
    try:
        path = _build(compiler)
        return SkinnyLinear(ctypes.CDLL(str(path))), ""
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building the decode kernel failed: {e}"


def avx512() -> bool:
    """Whether this CPU has AVX-512 (the kernel's wide path, the one measured)."""
    return " avx512f" in _cpu_flags()


@functools.cache
def _cpu_flags() -> str:
    """The first CPU's `flags` line of /proc/cpuinfo ('' where there is none)."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                    "")
    except OSError:
        return ""


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    cpu = _cpu_flags() or platform.processor()
    key = hashlib.sha256("\0".join((SOURCE, " ".join(FLAGS), version, cpu)).encode()).hexdigest()[:16]
    target = kernels_dir() / f"skinny_linear-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "skinny_linear.cpp"
        source.write_text(SOURCE)
        built = Path(tmp) / target.name
        done = subprocess.run([compiler, *FLAGS, str(source), "-o", str(built)], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise OSError(f"{compiler} exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
        os.replace(built, target)   # atomic: processes building at once all end with a whole file
    return target
