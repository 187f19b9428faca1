"""The engine's INFO log leaves the console by default and goes whole to engine.log in the run directory."""

import logging

import pytest

from turnrl.engines.logs import route_engine_logs


@pytest.fixture
def vllm_logger():
    logger = logging.getLogger("vllm")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield logger
    for h in logger.handlers:
        if h not in saved[0]:
            h.close()
    logger.handlers[:], logger.level, logger.propagate = saved


def test_info_goes_to_the_file_and_warnings_to_the_console_too(tmp_path, vllm_logger, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "1")   # restored after the test (route only sets a default)
    path = route_engine_logs("vllm", tmp_path, show=False)
    assert path == (tmp_path / "engine.log").resolve()
    log = logging.getLogger("vllm.engine.core")
    log.info("Initializing a V1 LLM engine with config: model=...")
    log.warning("libtcmalloc is not found")
    err = capsys.readouterr().err
    assert "libtcmalloc" in err and "Initializing" not in err
    text = path.read_text()
    assert "Initializing a V1 LLM engine" in text and "libtcmalloc" in text
    assert route_engine_logs("vllm", tmp_path, show=False) == path   # twice: no second file handler
    assert sum(isinstance(h, logging.FileHandler) for h in vllm_logger.handlers) == 1


def test_engine_logs_true_and_other_engines_leave_logging_alone(tmp_path, vllm_logger):
    before = list(vllm_logger.handlers)
    assert route_engine_logs("vllm", tmp_path, show=True) is None
    assert route_engine_logs("hf", tmp_path, show=False) is None
    assert vllm_logger.handlers == before and not (tmp_path / "engine.log").exists()
