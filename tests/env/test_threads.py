"""The environment's daemon worker threads: reused when idle, a new one when all are busy, gone when idle long."""

import asyncio
import threading
import time

import pytest

from turnrl.env.threads import DaemonThreads, in_daemon_thread


def run_and_wait(pool: DaemonThreads, job) -> None:
    done = threading.Event()

    def wrapped() -> None:
        try:
            job()
        finally:
            done.set()
    pool.submit(wrapped)
    assert done.wait(5)


def test_an_idle_worker_takes_the_next_job():
    pool = DaemonThreads(idle_s=5)
    names = []
    for _ in range(20):
        run_and_wait(pool, lambda: names.append(threading.current_thread().ident))
        time.sleep(0.001)   # the worker counts itself idle after its job
    assert pool.started == 1 and len(set(names)) == 1


def test_no_job_waits_for_a_busy_worker():
    pool = DaemonThreads(idle_s=5)
    release, running = threading.Event(), threading.Semaphore(0)

    def block() -> None:
        running.release()
        release.wait(5)
    for _ in range(8):
        pool.submit(block)
    for _ in range(8):   # all eight run at once: none queued behind another
        assert running.acquire(timeout=5)
    assert pool.started == 8
    release.set()


def test_workers_idle_past_the_limit_exit_and_later_jobs_still_run():
    pool = DaemonThreads(idle_s=0.05, name="turnrl-test-idle")
    run_and_wait(pool, lambda: None)
    deadline = time.monotonic() + 5
    while any(t.name == "turnrl-test-idle" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "turnrl-test-idle" for t in threading.enumerate())
    seen = []
    run_and_wait(pool, lambda: seen.append(1))
    assert seen == [1] and pool.started == 2


def test_jobs_submitted_while_workers_time_out_all_run():
    """Workers timing out while jobs arrive: every job runs exactly once."""
    pool = DaemonThreads(idle_s=0.001)
    count, lock, done = [0], threading.Lock(), threading.Semaphore(0)

    def job() -> None:
        with lock:
            count[0] += 1
        done.release()
    for k in range(400):
        pool.submit(job)
        if k % 7 == 0:
            time.sleep(0.002)
    for _ in range(400):
        assert done.acquire(timeout=5)
    assert count[0] == 400


def test_the_future_carries_results_and_errors():
    async def main():
        assert await in_daemon_thread(lambda: 41 + 1) == 42
        with pytest.raises(ValueError, match="bad"):
            await in_daemon_thread(lambda: (_ for _ in ()).throw(ValueError("bad")))

        def stop():
            raise StopIteration
        with pytest.raises(RuntimeError, match="StopIteration"):
            await in_daemon_thread(stop)
    asyncio.run(main())
