"""The python sandbox, attacked: each test runs model-style code that tries to break out, and checks it can't.

Every property is checked from the host's side too (the listener got no connection, no process is left on
the host, the secret stayed where it was), not only from what the snippet printed.
"""

import os
import re
import signal
import socket
import threading
import time

import pytest

from turnrl.config import ConfigError
from turnrl.config.schema import ToolSpec
from turnrl.env import sandbox
from turnrl.env.builtin.python_sandbox import PythonSandbox
from turnrl.env.loading import tool_factory
from turnrl.env.sandbox import SandboxPool, SandboxSettings, SandboxUnavailable, WorkerCrashed

SETTINGS = SandboxSettings(timeout_s=2.0, workers=2, max_procs=16, memory_mb=256, file_mb=4, work_mb=16,
                           max_output_bytes=2000)


@pytest.fixture(scope="module")
def pool():
    pool = SandboxPool(SETTINGS)
    assert pool.isolate, "the sandbox must be isolated on this machine"
    yield pool
    pool.close()


def host_processes(pattern: str) -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if re.search(pattern, cmd):
            out.append(f"{pid}: {cmd}")
    return out


# -- files ----------------------------------------------------------------------------------------------------
def test_files_outside_the_working_directory_cannot_be_read(pool, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    secret.chmod(0o644)                    # readable by every user on the host: only the mount view hides it
    code = f"""
import os
for path in ["/etc/shadow", "/etc/passwd", {str(secret)!r}, {__file__!r}, "/proc/self/environ", "/root/.bashrc"]:
    try:
        print(path, "READ", open(path).read()[:20])
    except OSError as exc:
        print(path, "denied", type(exc).__name__)
print("root:", sorted(os.listdir("/")))
print("cwd:", os.getcwd(), os.listdir("."))
"""
    result = pool.run(code)
    assert result.exit == 0, result.output
    assert "READ" not in result.output and "hunter2" not in result.output
    assert result.output.count("denied") == 6
    listed = re.search(r"root: \[(.*)\]", result.output).group(1)
    assert set(re.findall(r"'(\w+)'", listed)) <= {"bin", "dev", "lib", "lib64", "lib32", "libx32", "root", "sbin",
                                                   "usr", "work"}
    assert re.search(r"cwd: /work/\d+ \[\]", result.output)      # an empty working directory


def test_the_root_is_read_only_and_the_chroot_cannot_be_left(pool):
    code = """
import os
for attempt in ("open('/usr/evil', 'w')", "open('/evil', 'w')", "os.chroot('.')", "os.setuid(0)",
                "os.mkdir('/work/../escape')"):
    try:
        eval(attempt)
        print(attempt, "WORKED")
    except OSError as exc:
        print(attempt, "denied", exc.errno)
print("ids", os.getresuid(), os.getgroups())
"""
    result = pool.run(code)
    assert "WORKED" not in result.output, result.output
    assert "ids (65534, 65534, 65534) []" in result.output or os.geteuid() != 0


def test_setuid_binaries_give_nothing_back(pool):
    result = pool.run("import subprocess\nprint(subprocess.run(['su', '-c', 'id'], capture_output=True))\n"
                      "print(subprocess.run(['id', '-u'], capture_output=True, text=True).stdout)")
    assert "uid=0" not in result.output and "\n0\n" not in result.output, result.output


# -- network --------------------------------------------------------------------------------------------------
def test_no_network_not_even_the_hosts_loopback(pool):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    code = f"""
import socket
for target in [("127.0.0.1", {port}), ("8.8.8.8", 53), ("localhost", {port})]:
    try:
        socket.create_connection(target, timeout=1).close()
        print(target, "CONNECTED")
    except OSError as exc:
        print(target, "refused", type(exc).__name__)
"""
    result = pool.run(code)
    assert "CONNECTED" not in result.output and result.output.count("refused") == 3, result.output
    with pytest.raises(socket.timeout):
        listener.accept()                   # and the host's side saw nothing either
    listener.close()


# -- processes and time -----------------------------------------------------------------------------------------
def test_a_fork_bomb_is_capped_and_cleaned_up(pool):
    counted = pool.run("""
import os, time
n = 0
for _ in range(500):
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
    except OSError:
        break
print("forked", n)
""")
    forked = int(re.search(r"forked (\d+)", counted.output).group(1))
    assert 0 < forked < SETTINGS.max_procs, counted.output     # the rlimit, counted inside this worker only
    start = time.monotonic()
    bomb = pool.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    assert bomb.timed_out and time.monotonic() - start < SETTINGS.timeout_s + 2
    assert pool.run("print('still here')").output == "still here\n"
    assert not host_processes(r"sandbox_worker.*defunct")


def test_nothing_outlives_the_call(pool):
    marker = "987654"
    for code in [f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)",
                 f"import os\nif os.fork() == 0:\n    os.setsid()\n    os.execvp('sleep', ['sleep', '{marker}'])",
                 f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)\nwhile True: pass"]:
        pool.run(code)
        time.sleep(0.1)
        assert not host_processes(rf"^sleep {marker}"), code


def test_a_child_that_writes_on_after_its_parent_exits_does_not_hold_the_call(pool):
    start = time.monotonic()
    result = pool.run("import os\nif os.fork() == 0:\n    while True:\n        os.write(1, b'x' * 4096)\nprint('done')")
    assert result.exit == 0 and not result.timed_out and time.monotonic() - start < SETTINGS.timeout_s
    assert pool.run("print('next')").output == "next\n"


def test_an_endless_loop_is_killed_at_its_timeout_and_the_worker_recycled(pool):
    start = time.monotonic()
    before = set(pool.worker_pids())
    result = pool.run("while True:\n    pass")
    elapsed = time.monotonic() - start
    assert result.timed_out and result.signal == "SIGKILL"
    assert SETTINGS.timeout_s <= elapsed < SETTINGS.timeout_s + 1.5
    time.sleep(0.5)                                              # the replacement starts in the background
    assert before - set(pool.worker_pids()), "the worker that timed out must be replaced"


def test_cpu_time_is_limited_separately_from_the_wall_clock():
    pool = SandboxPool(SandboxSettings(timeout_s=10, cpu_s=1, workers=1))
    try:
        start = time.monotonic()
        result = pool.run("while True:\n    pass")
        assert result.signal == "SIGXCPU" and not result.timed_out and time.monotonic() - start < 5
    finally:
        pool.close()


def test_memory_and_file_size_limits(pool):
    memory = pool.run("x = bytearray(1 << 30)")
    assert "MemoryError" in memory.output and memory.exit == 1
    big = pool.run("open('big', 'wb').write(b'0' * (64 << 20))")
    assert "File too large" in big.output and big.exit == 1
    many = pool.run("for i in range(100):\n    open(f'f{i}', 'wb').write(b'0' * (3 << 20))")
    assert "No space left on device" in many.output          # the working directory is a small tmpfs


# -- secrets and output -----------------------------------------------------------------------------------------
def test_no_inherited_secrets(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-for-the-model")
    monkeypatch.setenv("WANDB_API_KEY", "wandb-test-not-for-the-model")
    pool = SandboxPool(SandboxSettings(workers=1))                  # started after the keys were set
    try:
        result = pool.run("import os\nprint(dict(os.environ))")
        assert "not-for-the-model" not in result.output and "HOME" in result.output
        (pid,) = pool.worker_pids()
        assert b"not-for-the-model" not in open(f"/proc/{pid}/environ", "rb").read()
    finally:
        pool.close()


def test_output_is_cut_and_decoded(pool):
    flood = pool.run("print('x' * 100_000)")
    assert flood.truncated and len(flood.output.encode()) <= SETTINGS.max_output_bytes
    raw = pool.run("import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe\\xc3')")
    assert raw.output == "ok \ufffd\ufffd\ufffd" and raw.exit == 0


def test_errors_and_exits_are_the_codes_own_output(pool):
    assert pool.run("1/0").output.endswith("ZeroDivisionError: division by zero\n")
    assert "SyntaxError" in pool.run("def (:").output
    assert pool.run("import sys\nsys.exit(3)").exit == 3
    assert pool.run("import os\nos.kill(os.getpid(), 9)").signal == "SIGKILL"


# -- the pool ---------------------------------------------------------------------------------------------------
def test_workers_are_reused_and_the_concurrency_is_limited(pool):
    pool.run("pass")
    pids = set(pool.worker_pids())
    for _ in range(3):
        pool.run("pass")
    assert set(pool.worker_pids()) == pids
    spans = []

    def one():
        out = pool.run("import time\nstart = time.time()\ntime.sleep(0.4)\nprint(start, time.time())").output
        spans.append(tuple(map(float, out.split())))
    threads = [threading.Thread(target=one) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(spans) == 5
    most = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    assert most <= SETTINGS.workers


def test_a_worker_killed_mid_call_is_an_error_and_is_replaced(pool):
    def kill_soon():
        deadline = time.monotonic() + 10
        while not pool.busy_pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        for pid in pool.busy_pids():
            os.killpg(pid, signal.SIGKILL)
    threading.Thread(target=kill_soon).start()
    with pytest.raises(WorkerCrashed, match="died during the call"):
        pool.run("import time\ntime.sleep(1.5)")
    assert pool.run("print(6 * 7)").output == "42\n"


def test_a_worker_that_died_while_idle_is_replaced_silently(pool):
    pool.run("pass")
    killed = list(pool.idle)
    for pid in pool.worker_pids():
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10       # dead (and reaped) before the call, however slow the machine
    while any(w.alive for w in killed) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.run("print('fresh')").output == "fresh\n"


# -- refusing to run unisolated -----------------------------------------------------------------------------------
def test_without_isolation_it_refuses_unless_allowed(monkeypatch, capsys):
    real = sandbox.Worker.__init__

    def no_namespaces(self, settings, isolate):
        if isolate:
            raise SandboxUnavailable("cannot create namespaces ([Errno 1] unshare: Operation not permitted)")
        real(self, settings, isolate)
    monkeypatch.setattr(sandbox.Worker, "__init__", no_namespaces)
    with pytest.raises(SandboxUnavailable, match="allow_unisolated: true"):
        SandboxPool(SandboxSettings(workers=1))
    with pytest.raises(ConfigError, match="isolation is unavailable"):
        tool_factory(ToolSpec(class_name="python", config={"workers": 1, "timeout_s": 1.5}))
    pool = SandboxPool(SandboxSettings(workers=1, timeout_s=1.0, allow_unisolated=True))
    try:
        assert not pool.isolate and "without isolation" in capsys.readouterr().err
        assert pool.run("print(1 + 1)").output == "2\n"
        marker = "876543"
        result = pool.run(f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'])\nwhile True: pass")
        assert result.timed_out
        time.sleep(0.1)
        assert not host_processes(rf"^sleep {marker}")           # its process group is still killed
    finally:
        pool.close()


# -- the tool -------------------------------------------------------------------------------------------------------
def test_the_python_tool_is_a_builtin_with_its_config():
    name, make = tool_factory(ToolSpec(class_name="python", config={"timeout_s": 1.0, "workers": 1}))
    tool = make()
    assert name == "python" and isinstance(tool, PythonSandbox)
    out = tool.execute({"code": "print(sum(range(10)))"})
    assert out.text == "45\n" and out.metrics["exit"] == 0
    # a sleep, not a busy loop: a busy loop races the 1 s CPU limit (SIGXCPU) against the 1 s wall deadline
    slow = tool.execute({"code": "import time; time.sleep(30)"})
    assert slow.text == "[timed out after 1s; it and everything it started were killed]"
    assert slow.metrics["timed_out"] == 1
    assert tool.execute({"code": "import sys; sys.exit(2)"}).text == "[exit status 2]"
    assert tool.execute({"code": ""}).text == "(no output)"
    with pytest.raises(ConfigError, match="memory_mb"):
        tool_factory(ToolSpec(class_name="python", config={"memory_mb": 0}))
    with pytest.raises(ConfigError, match="unexpected keyword argument 'memry_mb'"):
        tool_factory(ToolSpec(class_name="python", config={"memry_mb": 64}))


def test_import_paths_are_visible_read_only(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "helper_mod.py").write_text("VALUE = 41\n")
    pool = SandboxPool(SandboxSettings(workers=1, import_paths=(str(lib),)))
    try:
        result = pool.run("import helper_mod\nprint(helper_mod.VALUE + 1)\nopen(helper_mod.__file__ + 'x', 'w')")
        assert result.output.startswith("42\n") and "Read-only file system" in result.output, result.output
    finally:
        pool.close()
