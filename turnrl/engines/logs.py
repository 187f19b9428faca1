"""Where an engine's own log goes. vLLM writes INFO lines and its whole engine config to the console while it
starts; a newcomer's terminal should show turnrl's progress and step table, and the engine's warnings and
errors. So by default vLLM does not configure logging itself (VLLM_CONFIGURE_LOGGING=0, set before vLLM is
first imported) and its logger gets two handlers here: the console (stderr) at WARNING and up, and
`engine.log` in the run directory with everything at INFO and up. `logging.engine_logs: true` leaves vLLM's own
logging as it is (all of it on the console)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def route_engine_logs(kind: str, run_dir: str | Path | None, show: bool) -> Path | None:
    """Before a `kind` engine starts: its console log quiet, its full log in run_dir/engine.log (returned)."""
    if show or kind != "vllm":
        return None
    if "vllm" not in sys.modules:      # once vLLM is imported, it has configured its logging already
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    logger = logging.getLogger("vllm")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.WARNING)
    if not any(getattr(h, "_turnrl_console", False) for h in logger.handlers):
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        console._turnrl_console = True   # type: ignore[attr-defined]
        logger.addHandler(console)
    if run_dir is None:
        return None
    path = (Path(run_dir) / "engine.log").resolve()
    if not any(getattr(h, "baseFilename", None) == str(path) for h in logger.handlers):
        path.parent.mkdir(parents=True, exist_ok=True)
        file = logging.FileHandler(path)
        file.setLevel(logging.INFO)
        file.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(file)
    return path
