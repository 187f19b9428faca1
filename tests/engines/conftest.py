import pytest


@pytest.fixture
def interpreted(monkeypatch):
    """The fast engine's Triton kernels built for Triton's CPU interpreter (numpy), rebuilt for what comes after."""
    from turnrl.engines.fast import cache_kernel, sample_kernel
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    caches = (sample_kernel._kernels, cache_kernel._kernel)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()
