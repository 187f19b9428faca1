"""Daemon worker threads for the environment's sync callables (tools, simulated users, reward functions).

Not `concurrent.futures`: a pool's threads are joined when the interpreter exits, so one call blocked for good
(a dead socket read) kept the process alive after the run's summary. These threads are daemons, abandoned at
exit; such a call has already timed out and been recorded.

A call never waits for a free worker while its timeout runs: when no worker is idle, a new one starts. Idle
workers are reused, so a run's thousands of calls do not each start a thread. Starting one blocks the caller
until the new thread holds the GIL, which took 0.9 ms a call on the event loop here with the engine's thread
busy, across 1,536 simulated-user replies of one multi-turn batch. A worker idle for `idle_s` exits.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Callable


class DaemonThreads:
    """Runs jobs on daemon threads: an idle one if there is one, else a new one."""

    def __init__(self, idle_s: float = 30.0, name: str = "turnrl-worker"):
        self.idle_s, self.name = idle_s, name
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0           # workers waiting for a job, less the jobs queued for them
        self.started = 0         # threads started so far (for tests and stats)

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._idle > 0:
                self._idle -= 1
                self._jobs.put(job)   # under the lock: a worker that times out sees the job reserved for it
                return
            self.started += 1
        threading.Thread(target=self._work, args=(job,), name=self.name, daemon=True).start()

    def _work(self, job: Callable[[], None]) -> None:
        while True:
            job()
            job = None  # type: ignore[assignment]  # drop its references while idle
            with self._lock:
                self._idle += 1
            try:
                job = self._jobs.get(timeout=self.idle_s)
                continue
            except queue.Empty:
                pass
            with self._lock:
                try:   # a job queued between the timeout and the lock counted on this worker
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    self._idle -= 1
                    return


_THREADS = DaemonThreads(name="turnrl-tool")


def in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """`fn()` on a daemon worker thread, as a future of the running loop. An exception it raises is the future's;
    StopIteration, which a future cannot hold, becomes a RuntimeError."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            value, failed = fn(), False
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            value, failed = (exc if not isinstance(exc, StopIteration) else RuntimeError(repr(exc))), True

        def settle() -> None:
            if not future.done():
                future.set_exception(value) if failed else future.set_result(value)
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass  # the loop is closed: nobody waits for this call any more
    _THREADS.submit(run)
    return future
