"""Shared fixtures: the real small model (SmolLM2-135M-Instruct) prepared once in the turnrl cache."""

from pathlib import Path

import pytest

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from turnrl.models import resolve
    return resolve(SMOLLM2)


@pytest.fixture(scope="session")
def smol_tokenizer(smollm2_dir):
    """The real SmolLM2 tokenizer. Shared: copy it (copy.deepcopy) before changing it."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def smol_template(smol_tokenizer):
    """turnrl's ChatTemplate over the shared SmolLM2 tokenizer."""
    from turnrl.chat.templates import ChatTemplate
    return ChatTemplate(smol_tokenizer)


@pytest.fixture(scope="session")
def torch_threads():
    """torch_threads(n): a context manager that sets torch's thread count and restores it.

    Engines built here run on one thread: on a shared 2-core machine a second OpenMP thread makes each
    decode step wait on a descheduled peer (3-10x slower under load). A thread takes the count at its first
    parallel op, so an engine's worker must make that op (a warm-up request) inside the `with`.
    """
    import contextlib

    import torch

    @contextlib.contextmanager
    def threads(n: int):
        old = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(old)
    return threads
