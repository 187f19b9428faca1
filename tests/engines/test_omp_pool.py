"""Idle threads give back their OpenMP workers: the call ends them, the engine's worker makes it when it runs out
of requests, and the trainer before it waits on a rollout."""

import asyncio
import os
import threading
import time

import pytest
import torch

import turnrl.engines.worker as worker
from turnrl.engines import omp_pool
from turnrl.engines.base import Sampling
from turnrl.engines.hf import HFEngine
from turnrl.models import resolve


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def wait_for(condition, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                    reason="counts the threads of a 2-thread pool through /proc")
def test_release_ends_the_calling_thread_s_workers(torch_threads):
    with torch_threads(2):
        a = torch.randn(256, 256)

        def work_then_release(out: list) -> None:
            a @ a                                       # this thread's pool: one more thread in the process
            out.append(threads())
            out.append(omp_pool.release_idle_pool())
            out.append(wait_for(lambda: threads() < out[0]))

        out: list = []
        t = threading.Thread(target=work_then_release, args=(out,))
        t.start()
        t.join()
    if out[1] is False:
        pytest.skip("no libgomp in this process (PyTorch built with another OpenMP)")
    assert out[2], "the released pool's worker thread did not end"


def test_the_engine_s_worker_releases_when_it_runs_out_of_requests(torch_threads, monkeypatch):
    released: list[str] = []
    monkeypatch.setattr(worker, "release_idle_pool", lambda: released.append(threading.current_thread().name))

    async def go(e):
        assert wait_for(lambda: len(released) >= 1)    # idle from the start
        before = len(released)
        await e.generate([5, 6, 7], Sampling(max_tokens=4, temperature=0.0, stop_token_ids=()))
        assert wait_for(lambda: len(released) > before)
        await e.close()

    with torch_threads(1):
        e = HFEngine(str(resolve("tiny-random")), device="cpu", dtype="float32", gather_ms=0)
        asyncio.run(go(e))
    assert set(released) == {"turnrl-hf-engine"}
