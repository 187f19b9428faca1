"""A pool of isolated Python workers for model-written code (the built-in `python` tool runs on it).

What runs inside a worker, and how it is isolated, is in `turnrl.env.sandbox_worker` (namespaces, a private
read-only root, an unprivileged uid without capabilities, no network, rlimits, a kill of everything the code
started). This side starts workers and hands them code:

- `SandboxPool` keeps `workers` workers started ahead of time. A call takes an idle one and waits while all
  are busy: that is the concurrency limit. Each worker runs one snippet at a time, each snippet in a fresh
  process with a fresh empty directory, so nothing carries over from one call (or trajectory) to the next.
- A worker whose snippet timed out, or which died or stopped answering (deadline: the snippet's timeout plus
  `GRACE_S`), is killed with its process group, which ends its PID namespace and everything in it, and a new
  one is started for the next call. A worker found dead before the call started is replaced and the call
  goes on; one that dies during a call raises `WorkerCrashed` (an environment failure for the tool layer).
- Isolation is required: if the namespaces cannot be set up (an old kernel, a container that forbids user
  namespaces), starting the pool raises `SandboxUnavailable`, unless `allow_unisolated` was set, in which
  case the workers run without namespaces and a warning says so.
- `pool_for(settings)` shares one pool per distinct settings in the process; every worker is killed at exit,
  and a worker whose host process dies sees its stdin close and exits, taking its namespace with it.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

WORKER_FILE = str(Path(__file__).with_name("sandbox_worker.py"))
GRACE_S = 5.0                 # beyond the snippet's timeout, for process start-up and clean-up
START_TIMEOUT_S = 20.0
NOBODY = 65534
MAX_CODE_BYTES = 1 << 20


class SandboxUnavailable(RuntimeError):
    """Isolation cannot be set up on this machine (and running without it was not allowed)."""


class WorkerCrashed(RuntimeError):
    """A worker died or stopped answering during a call."""


@dataclass(frozen=True)
class SandboxSettings:
    timeout_s: float = 5.0               # wall clock per snippet
    cpu_s: int = 0                       # CPU seconds per snippet; 0: one past the timeout (rounded up), so
                                         # a busy loop is killed by the wall clock and reported as timed out
    memory_mb: int = 512                 # address space per process
    file_mb: int = 16                    # largest file the code may write
    work_mb: int = 64                    # the working directory's size (a tmpfs)
    max_procs: int = 32                  # processes of the sandbox user at once (the supervisor included)
    max_output_bytes: int = 16_384       # stdout + stderr kept; the rest is counted and dropped
    import_paths: tuple[str, ...] = ()   # extra directories visible read-only and on sys.path (e.g. numpy's)
    workers: int = 4                     # pre-started workers = snippets running at once
    allow_unisolated: bool = False       # run without namespaces where they cannot be set up (unsafe)

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "file_mb", "work_mb", "max_procs", "max_output_bytes", "workers"):
            if not getattr(self, name) > 0:
                raise ValueError(f"python sandbox: '{name}' must be > 0, got {getattr(self, name)!r}")
        if self.cpu_s < 0:
            raise ValueError(f"python sandbox: 'cpu_s' must be >= 0 (0: the timeout), got {self.cpu_s!r}")
        if self.max_procs < 2:
            raise ValueError("python sandbox: 'max_procs' must be >= 2 (the supervisor and the code's process)")
        missing = [p for p in self.import_paths if not Path(p).is_dir()]
        if missing:
            raise ValueError(f"python sandbox: import_paths that are not directories: {missing}")


@dataclass
class RunResult:
    output: str                # stdout and stderr, interleaved, cut at max_output_bytes
    exit: int | None           # exit status, None when killed by a signal
    signal: str | None         # e.g. SIGKILL, SIGXCPU
    timed_out: bool
    truncated: bool
    seconds: float


def _environment() -> dict[str, str]:
    """The worker's whole environment: nothing of the host's (API keys, tokens) is passed on."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


class Worker:
    """One worker process (and, isolated, its namespaces); runs one snippet at a time."""

    def __init__(self, settings: SandboxSettings, isolate: bool):
        self.settings = settings
        self.isolate = isolate
        self.host_dir = tempfile.mkdtemp(prefix="turnrl-sandbox-")
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", WORKER_FILE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=_environment(),
                                     cwd=self.host_dir, start_new_session=True)
        try:
            self._start()
        except BaseException:
            self.kill()
            raise

    def _start(self) -> None:
        s = self.settings
        root = os.geteuid() == 0
        uid, gid = (NOBODY, NOBODY) if root else (os.geteuid(), os.getegid())
        readonly = [os.path.realpath(sys.base_prefix)] + [os.path.realpath(p) for p in s.import_paths]
        self._send({"settings": {
            "isolate": self.isolate, "host_dir": self.host_dir, "uid": uid, "gid": gid, "readonly": readonly,
            "timeout_s": s.timeout_s, "cpu_s": s.cpu_s or int(-(-s.timeout_s // 1)) + 1,
            "memory_mb": s.memory_mb, "file_mb": s.file_mb, "work_mb": s.work_mb, "max_procs": s.max_procs,
            "max_output_bytes": s.max_output_bytes, "import_paths": readonly[1:]}})
        deadline = time.monotonic() + START_TIMEOUT_S
        reply = self._answer(deadline, "starting")
        if self.isolate and reply.get("unshared"):
            pid = self.proc.pid
            try:  # the host maps the ids: from inside, only the creator's own uid could be mapped
                Path(f"/proc/{pid}/setgroups").write_text("deny")
                Path(f"/proc/{pid}/uid_map").write_text(f"{uid} {uid} 1")
                Path(f"/proc/{pid}/gid_map").write_text(f"{gid} {gid} 1")
            except OSError as exc:
                raise SandboxUnavailable(f"cannot map ids into the sandbox's user namespace ({exc})") from None
            self._send({"mapped": True})
            reply = self._answer(deadline, "starting")
        if "error" in reply:
            raise SandboxUnavailable(reply["error"])
        if not reply.get("ready"):
            raise SandboxUnavailable(f"unexpected answer from a starting sandbox worker: {reply}")

    def _answer(self, deadline: float, what: str) -> dict:
        try:
            return self._receive(deadline)
        except (EOFError, TimeoutError, OSError) as exc:
            raise SandboxUnavailable(f"the sandbox worker failed while {what} ({type(exc).__name__}; "
                                     f"exit status {self.proc.poll()})") from None

    def _send(self, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.proc.stdin.write(struct.pack(">I", len(data)) + data)
        self.proc.stdin.flush()

    def _receive(self, deadline: float) -> dict:
        fd = self.proc.stdout.fileno()

        def exactly(n: int) -> bytes:
            buf = b""
            while len(buf) < n:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise TimeoutError
                chunk = os.read(fd, n - len(buf))
                if not chunk:
                    raise EOFError
                buf += chunk
            return buf
        return json.loads(exactly(struct.unpack(">I", exactly(4))[0]))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, code: str) -> RunResult:
        deadline = time.monotonic() + self.settings.timeout_s + GRACE_S
        self._send({"code": code})      # OSError (broken pipe) if the worker is gone: the pool retries
        try:
            return RunResult(**self._receive(deadline))
        except TimeoutError:
            raise WorkerCrashed(f"the sandbox worker did not answer within {self.settings.timeout_s + GRACE_S:g}s"
                                ) from None
        except (EOFError, OSError):
            self.proc.wait(timeout=5)
            raise WorkerCrashed(f"the sandbox worker died during the call (exit status {self.proc.returncode})"
                                ) from None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # the worker's PID namespace dies with its first process
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        shutil.rmtree(self.host_dir, ignore_errors=True)


class SandboxPool:
    def __init__(self, settings: SandboxSettings):
        self.settings = settings
        self.isolate = True
        self.slots = threading.BoundedSemaphore(settings.workers)
        self.lock = threading.Lock()
        self.closed = False
        self.busy: set[Worker] = set()
        try:
            first = Worker(settings, isolate=True)
        except SandboxUnavailable as exc:
            if not settings.allow_unisolated:
                raise SandboxUnavailable(
                    f"python sandbox: isolation is unavailable here: {exc}. Model-written code is not run without "
                    "it; to run it anyway (it can then read what this user can read and reach the network), set "
                    "allow_unisolated: true in the tool's config.") from None
            print(f"[turnrl] WARNING: python sandbox without isolation ({exc}); allowed by allow_unisolated",
                  file=sys.stderr, flush=True)
            self.isolate = False
            first = Worker(settings, isolate=False)
        self.idle = [first]
        try:
            self.idle += [Worker(settings, self.isolate) for _ in range(settings.workers - 1)]
        except BaseException:
            self.close()
            raise

    def _take(self) -> Worker:
        with self.lock:
            if self.closed:
                raise RuntimeError("the python sandbox pool is closed")
            while self.idle:
                worker = self.idle.pop()
                if worker.alive:
                    return worker
                worker.kill()
        return Worker(self.settings, self.isolate)

    def run(self, code: str) -> RunResult:
        if len(code.encode("utf-8", "surrogatepass")) > MAX_CODE_BYTES:
            raise ValueError(f"code longer than {MAX_CODE_BYTES} bytes")
        with self.slots:
            worker = self._take()
            self.busy.add(worker)
            try:
                try:
                    result = worker.run(code)
                except OSError:          # it died while idle: a fresh one runs the call
                    worker.kill()
                    self.busy.discard(worker)
                    worker = Worker(self.settings, self.isolate)
                    self.busy.add(worker)
                    result = worker.run(code)
            except BaseException:
                worker.kill()
                self._replace()
                raise
            finally:
                self.busy.discard(worker)
            if result.timed_out:        # recycled: a worker that hit a limit starts over clean
                worker.kill()
                self._replace()
            else:
                with self.lock:
                    if self.closed:
                        worker.kill()
                    else:
                        self.idle.append(worker)
            return result

    def _replace(self) -> None:
        """Start a worker in the background for the one just killed, so the next call need not wait for it."""
        def start() -> None:
            try:
                worker = Worker(self.settings, self.isolate)
            except Exception:  # noqa: BLE001 - the next call starts one itself and reports the failure
                return
            with self.lock:
                if self.closed or len(self.idle) >= self.settings.workers:
                    worker.kill()
                else:
                    self.idle.append(worker)
        threading.Thread(target=start, name="turnrl-sandbox-start", daemon=True).start()

    def worker_pids(self) -> list[int]:
        """Process ids of the idle workers (each the leader of its process group)."""
        with self.lock:
            return [w.proc.pid for w in self.idle]

    def busy_pids(self) -> list[int]:
        return [w.proc.pid for w in list(self.busy)]

    def close(self) -> None:
        with self.lock:
            self.closed = True
            idle, self.idle = self.idle, []
        for worker in idle:
            worker.kill()


_POOLS: dict[SandboxSettings, SandboxPool] = {}
_POOLS_LOCK = threading.Lock()


def pool_for(settings: SandboxSettings) -> SandboxPool:
    """The process's pool for these settings, started on first use."""
    with _POOLS_LOCK:
        pool = _POOLS.get(settings)
        if pool is None or pool.closed:
            pool = _POOLS[settings] = SandboxPool(settings)
        return pool


@atexit.register
def close_pools() -> None:
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


