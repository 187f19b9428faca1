"""The embedded engines' step lock: a weight update waiting for the worker gets in at the next step boundary."""

import threading
import time

from turnrl.engines.worker import StepLock


def run_worker(lock, steps, stop, step_s=0.001):
    def work():
        while not stop.is_set():
            with lock.step():           # a decode step that holds the GIL, as the engines' Python between
                end = time.perf_counter() + step_s   # kernels does: a plain lock lets it starve the update
                while time.perf_counter() < end:
                    pass
                steps.append(1)
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def test_an_update_waits_at_most_one_step():
    lock, steps, stop = StepLock(), [], threading.Event()
    thread = run_worker(lock, steps, stop)
    try:
        waits = []
        for _ in range(20):
            while len(steps) < 3:
                time.sleep(0.001)
            # Count from the moment the request is made: holding the lock's condition (re-entrant) while reading
            # the count and asking keeps the worker from starting a step in between, however the threads are
            # scheduled; the step it is inside may still finish (that is the one step allowed).
            with lock._cv:
                asked = len(steps)
                with lock.exclusive():
                    waits.append(len(steps) - asked)
                    seen = len(steps)
                    time.sleep(0.005)
                    assert len(steps) == seen      # the worker does not step while the update holds the lock
            time.sleep(0.003)
        assert max(waits) <= 1, waits
    finally:
        stop.set()
        thread.join(5)


def test_the_worker_goes_on_after_the_update_and_updates_queue_up():
    lock, steps, stop = StepLock(), [], threading.Event()
    thread = run_worker(lock, steps, stop)
    order = []

    def update(tag):
        with lock.exclusive():
            order.append(tag)
            time.sleep(0.002)
    try:
        updates = [threading.Thread(target=update, args=(i,)) for i in range(4)]
        for t in updates:
            t.start()
        for t in updates:
            t.join(5)
        assert sorted(order) == [0, 1, 2, 3]
        before, deadline = len(steps), time.monotonic() + 5
        while len(steps) == before and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(steps) > before          # the worker was not left waiting
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()
