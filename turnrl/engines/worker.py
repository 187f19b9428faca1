"""What the embedded engines share: a request queue served by one worker thread, answered on the caller's loop.

`generate` validates a request, gives it a seed (the request's own, or one derived from the engine seed and a
counter), queues it, and waits; cancelling the wait marks the request aborted so the worker drops it. The
worker answers with `_resolve` from its own thread. Subclasses build their request records and run the loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any, Callable

from turnrl.engines.base import Completion, EngineError, Sampling


class WorkerEngine:
    join_timeout_s = 5.0   # how long `close` waits for the worker thread

    def _start_worker(self, name: str, seed: int) -> None:
        self.seed = seed
        self.version = 0
        self.in_flight = 0                 # requests submitted and not yet answered (for progress)
        self._pending: deque[Any] = deque()
        self._cv = threading.Condition()
        self._weights_lock = threading.Lock()
        self._closed = False
        self._counter = 0
        self._thread = threading.Thread(target=self._worker, name=name, daemon=True)
        self._thread.start()

    def _worker(self) -> None:
        raise NotImplementedError

    def _check(self, prompt_ids: list[int], sampling: Sampling) -> None:
        if self._closed:
            raise EngineError("engine is closed")
        if not prompt_ids:
            raise EngineError("empty prompt")
        if sampling.max_tokens < 1:  # the prefill always samples one token
            raise EngineError(f"max_tokens must be at least 1, got {sampling.max_tokens}")

    def _seed_for(self, sampling: Sampling) -> int:
        with self._cv:
            self._counter += 1
            return sampling.seed if sampling.seed is not None else self.seed * 1_000_003 + self._counter

    async def _submit(self, make: Callable[[asyncio.AbstractEventLoop, asyncio.Future], Any]) -> Completion:
        """Queue the request `make(loop, future)` builds and wait for the worker's answer."""
        loop = asyncio.get_running_loop()
        req = make(loop, loop.create_future())
        with self._cv:
            self._pending.append(req)
            self._cv.notify()
        self.in_flight += 1
        try:
            return await req.future
        except asyncio.CancelledError:
            req.aborted = True
            raise
        finally:
            self.in_flight -= 1

    async def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        await asyncio.to_thread(self._thread.join, self.join_timeout_s)

    def _resolve(self, req: Any, completion: Completion | None = None, exc: Exception | None = None) -> None:
        """Answer a request from the worker thread (on its caller's loop; a loop already gone is ignored)."""
        def set_result() -> None:
            if req.future.done():
                return
            if exc is not None:
                req.future.set_exception(exc)
            else:
                req.future.set_result(completion)
        try:
            req.loop.call_soon_threadsafe(set_result)
        except RuntimeError:
            pass
