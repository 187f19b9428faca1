"""Shared fixtures: the real small model (SmolLM2-135M-Instruct) prepared once in the turnrl cache; Triton
kernels under the interpreter."""

import os
import subprocess
import sys
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


class FakeOpenAI:
    """A scripted OpenAI-compatible chat server on a loopback port, for judge / simulated-user fault tests.

    Each request takes the next queued response (`push`), else `default(body)`. A response is (status, body,
    delay_s): body a dict is sent as JSON, a str as is. `requests` holds every request body and its headers.
    """

    def __init__(self):
        import collections
        import http.server
        import threading

        fake = self
        self.queue = collections.deque()
        self.default = lambda body: self.ok("{}")
        self.requests, self.headers = [], []
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                import json
                import time
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                with fake._lock:
                    fake.requests.append(body)
                    fake.headers.append(dict(self.headers))
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                    status, payload, delay = fake.queue.popleft() if fake.queue else fake.default(body)
                answered = False
                try:
                    time.sleep(delay)
                    data = (json.dumps(payload) if isinstance(payload, dict) else payload).encode()
                    with fake._lock:     # done before the client can see the answer and send its next request
                        fake.in_flight -= 1
                        answered = True
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout)
                finally:
                    if not answered:
                        with fake._lock:
                            fake.in_flight -= 1

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    @staticmethod
    def ok(content: str, prompt_tokens: int = 11, completion_tokens: int = 7, delay: float = 0.0):
        return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                  "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}}, delay

    def push(self, *responses):
        self.queue.extend(responses)

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_openai():
    """A FakeOpenAI server, stopped after the test."""
    server = FakeOpenAI()
    yield server
    server.stop()


@pytest.fixture
def closed_port_url():
    """The /v1 URL of a loopback port nothing listens on (connection refused)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


# Triton's interpreter must be on before triton is first imported: its library functions (tl.max, tl.sum,
# tl.cumsum) are compiled-mode jit functions once anything (torch.compile, vLLM) imported triton without it,
# and an interpreted kernel that calls them fails. So a test that asks for `interpreted` runs in a fresh
# Python with TRITON_INTERPRET=1 from its start, whatever this process imported before.
CHILD = "TURNRL_TEST_TRITON_INTERPRETER"


def interpreter_blocker(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter cannot run turnrl's kernels with these versions, or None. Triton before 3.7
    turns a scalar argument (a 1-element array) into a Python int with int(), which numpy 2.5 refuses
    ("only 0-dimensional arrays can be converted to Python scalars") at every `range` over a runtime bound;
    Triton 3.7 squeezes the array first. Seen on the GPU machine: Triton 3.6 with numpy 2.5.2."""
    from packaging.version import Version
    if Version(triton_version).release < (3, 7) and Version(numpy_version).release >= (2, 5):
        return (f"Triton {triton_version}'s interpreter cannot run with numpy {numpy_version} (int() of a "
                f"1-element array; fixed in Triton 3.7): the kernels run compiled in the gpu-marked tests")
    return None


@pytest.fixture
def interpreted(monkeypatch):
    """turnrl's Triton kernels (the fast engine's, the exact mode's) built for Triton's CPU interpreter (numpy),
    in a process of their own."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        blocker = interpreter_blocker(version("triton"), version("numpy"))
    except PackageNotFoundError:
        blocker = None   # no Triton: the kernels' own imports say so
    if blocker:
        pytest.skip(blocker)
    from turnrl.engines.fast import attention_kernel, cache_kernel, sample_kernel
    from turnrl.exact import triton_ops, triton_tree
    from turnrl.train import head_kernel
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    caches = (sample_kernel._kernels, cache_kernel._kernel, attention_kernel._kernels, triton_ops._attention_kernel,
              triton_ops._rms_kernel, triton_ops._matmul_kernel, triton_ops._elementwise_kernels,
              triton_tree._vocab_kernel, triton_tree._kernel, head_kernel._kernels)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if "interpreted" not in pyfuncitem.fixturenames or os.environ.get(CHILD) == "1":
        return None
    env = {**os.environ, CHILD: "1", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", pyfuncitem.nodeid],
                          cwd=pyfuncitem.config.rootpath, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"{pyfuncitem.nodeid} failed under Triton's interpreter (a fresh Python):\n"
                    f"{done.stdout[-6000:]}{done.stderr[-2000:]}", pytrace=False)
    return True


@pytest.fixture(autouse=True)
def _collectable_heap():
    """Engines freeze the heap when built (engine.gc_freeze): after a test that froze it, make it collectable
    again and collect, so one test process running hundreds of them frees what each leaves (models included)."""
    yield
    import gc
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()
