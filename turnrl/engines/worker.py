"""What the embedded engines share: a request queue served by one worker thread, answered on the caller's loop.

`generate` validates a request, gives it a seed (the request's own, or one derived from the engine seed and a
counter), queues it, and waits; cancelling the wait marks the request aborted so the worker drops it. The
worker answers with `_resolve` from its own thread. Subclasses build their request records and run the loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

from turnrl.engines.base import Completion, Delta, EngineBase, EngineError, Sampling
from turnrl.engines.omp_pool import release_idle_pool

Listener = Callable[[list[int], list[float]], None]   # called from the worker thread with each step's tokens


async def stream_through(start: Callable[[Listener], Awaitable[Completion]]) -> AsyncIterator[Delta | Completion]:
    """`Engine.stream` for engines whose worker thread reports tokens to a listener: run `start(listener)`, yield
    what the listener gets as `Delta`s, then the `Completion`. Tokens and the answer are both handed over with
    `call_soon_threadsafe`, in order, so every delta comes before the end. Leaving the iteration early cancels
    the request (the engine aborts it)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Delta | None] = asyncio.Queue()

    def listener(ids: list[int], logprobs: list[float]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, Delta(ids, logprobs))
    task = asyncio.ensure_future(start(listener))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while (item := await queue.get()) is not None:
            yield item
        yield task.result()
    finally:
        if not task.done():
            task.cancel()


class StepLock:
    """The worker holds it for one step at a time; a caller who asks (a weight update, a cache reset) gets it
    at the next step boundary. A plain lock is not fair: a worker that releases and re-takes it at once can
    keep a waiting update out until every request has finished, which silently turns a mid-request update
    into one after the requests."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._held = False
        self._waiting = 0

    @contextmanager
    def step(self) -> Iterator[None]:
        """For the worker: waits while anyone else holds the lock or is waiting for it."""
        with self._cv:
            self._cv.wait_for(lambda: not self._held and self._waiting == 0)
            self._held = True
        try:
            yield
        finally:
            self._release()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """For everyone else: served before the worker's next step."""
        with self._cv:
            self._waiting += 1
            try:
                self._cv.wait_for(lambda: not self._held)
            finally:
                self._waiting -= 1
            self._held = True
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        with self._cv:
            self._held = False
            self._cv.notify_all()


class WorkerEngine(EngineBase):
    join_timeout_s = 5.0   # how long `close` waits for the worker thread

    def _start_worker(self, name: str, seed: int) -> None:
        self.seed = seed
        self.version = 0
        self.in_flight = 0                 # requests submitted and not yet answered (for progress)
        self._pending: deque[Any] = deque()
        self._cv = threading.Condition()
        self._weights_lock = StepLock()
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

    def _take(self, fits: Callable[[list[Any], Any], bool | None], block: bool) -> list[Any]:
        """The next requests to start: wait for one (when `block`), give concurrent trajectories `gather_s` to
        join the same prefill, then take pending requests in order while `fits(taken, request)`; a None from
        `fits` leaves that request queued (in its place) and goes on; aborted requests are dropped on the way."""
        if block and not self._pending:
            release_idle_pool()          # idle: the trainer's thread computes next (omp_pool.py)
        with self._cv:
            if block:
                while not self._pending and not self._closed:
                    self._cv.wait()
        if block and self.gather_s > 0:
            time.sleep(self.gather_s)
        with self._cv:
            out: list[Any] = []
            waiting: list[Any] = []
            while self._pending:
                if self._pending[0].aborted:
                    self._pending.popleft()
                    continue
                verdict = fits(out, self._pending[0])
                if verdict is None:
                    waiting.append(self._pending.popleft())
                    continue
                if not verdict:
                    break
                out.append(self._pending.popleft())
            self._pending.extendleft(reversed(waiting))
            return out

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
