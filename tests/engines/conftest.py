import os
import subprocess
import sys

import pytest

# Triton's interpreter must be on before triton is first imported: its library functions (tl.max, tl.sum,
# tl.cumsum) are compiled-mode jit functions once anything (torch.compile, vLLM) imported triton without it,
# and an interpreted kernel that calls them fails. So a test that asks for `interpreted` runs in a fresh
# Python with TRITON_INTERPRET=1 from its start, whatever this process imported before.
CHILD = "TURNRL_TEST_TRITON_INTERPRETER"


@pytest.fixture
def interpreted(monkeypatch):
    """The fast engine's Triton kernels built for Triton's CPU interpreter (numpy), in a process of their own."""
    from turnrl.engines.fast import cache_kernel, sample_kernel
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    caches = (sample_kernel._kernels, cache_kernel._kernel)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if "interpreted" not in pyfuncitem.fixturenames or os.environ.get(CHILD) == "1":
        return None
    env = {**os.environ, CHILD: "1", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", pyfuncitem.nodeid],
                          cwd=pyfuncitem.config.rootpath, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"{pyfuncitem.nodeid} failed under Triton's interpreter (a fresh Python):\n"
                    f"{done.stdout[-6000:]}{done.stderr[-2000:]}", pytrace=False)
    return True
