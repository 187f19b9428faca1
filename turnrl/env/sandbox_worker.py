"""The inside of a python-sandbox worker: standard library only, started as `python -I -S sandbox_worker.py`.

`turnrl.env.sandbox` starts this file as a fresh interpreter (nothing of the host's memory, no inherited
environment, no site-packages) and talks to it over stdin/stdout in length-prefixed JSON messages:

    host -> worker   {"settings": {...}}                       once
    worker -> host   {"unshared": true} | {"error": "..."}      isolated only: the host writes the id maps now
    host -> worker   {"mapped": true}
    worker -> host   {"ready": true} | {"error": "..."}
    host -> worker   {"code": "..."}                            then one request per snippet
    worker -> host   {"output", "exit", "signal", "timed_out", "truncated", "seconds"}

Isolated (the default), the launched process unshares new user, mount, network, PID, IPC and UTS namespaces;
the host maps one unprivileged uid/gid into the user namespace (65534 when the host is root, else the
caller's own); the process then forks the supervisor, PID 1 of the new PID namespace, which builds a root
of its own: an empty tmpfs with read-only, nosuid bind mounts of /usr, /lib*, /bin, /sbin and the Python
installation, /dev/{null,zero,random,urandom}, and a size-limited tmpfs at /work. It chroots there, takes
the unprivileged ids, drops every capability and sets no_new_privs (so no setuid binary gives them back,
and without CAP_SYS_CHROOT the chroot cannot be left). The network namespace has only a loopback that is
down, so nothing can be reached, not even the host's 127.0.0.1.

Each snippet runs in a child forked from the supervisor: a fresh empty directory under /work, an empty
environment, rlimits on CPU time, address space, file size, processes and open files, stdout and stderr
into one pipe of which the first `max_output_bytes` are kept. At its wall-clock deadline, and in any case
once it has exited, the supervisor kills every other process of its PID namespace (`kill(-1)` from PID 1):
nothing the code started outlives the call. RLIMIT_NPROC counts per user namespace, so a fork bomb hits
`max_procs` inside its own worker and nowhere else.

Unisolated (only when the user allowed it and isolation is unavailable) the same worker runs without
namespaces: rlimits, an empty temporary directory, an empty environment and the process-group kill remain;
the code can read what the host user can and use the network, and as root RLIMIT_NPROC does not apply.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import shutil
import signal
import struct
import sys
import time
import traceback

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
# statvfs flags -> the mount flags a remount must keep (a user namespace may not clear them)
KEEP_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
              (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
DEVICES = ("null", "zero", "random", "urandom")
SNIPPET = "<python>"
DRAIN_S = 0.2                    # after the code's process exits, how long output is still read

libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def drop_capabilities() -> None:
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()   # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    _check(libc.capset(ctypes.byref(header), data), "capset")


# -- messages ------------------------------------------------------------------------------------------------
def send(obj: dict) -> None:
    data = json.dumps(obj).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(1, data):]


def receive() -> dict | None:
    def exactly(n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            chunk = os.read(0, n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf
    head = exactly(4)
    body = exactly(struct.unpack(">I", head)[0]) if head else None
    return None if body is None else json.loads(body)


# -- isolation ------------------------------------------------------------------------------------------------
def _remount_flags(path: str) -> int:
    """Read-only, nosuid, nodev, plus the flags of the source mount that a user namespace may not clear."""
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
    have = os.statvfs(path).f_flag
    for st, ms in KEEP_FLAGS:
        if have & st:
            flags |= ms
    return flags


def build_root(root: str, readonly: list[str], work_mb: int, uid: int, gid: int) -> None:
    """Mount a private root at `root`, take the unprivileged ids and chroot into it.

    The sources are opened before the ids change (the Python installation may sit under a directory only root
    can search), and mounted through /proc/self/fd afterwards: files created in the new root must belong to a
    uid that exists in the user namespace, and the host's root does not.
    """
    mount(None, "/", None, MS_REC | MS_PRIVATE)          # nothing below propagates back to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size=4m,mode=0755,uid={uid},gid={gid}")
    os.chdir(root)                                        # from here on, paths are relative to the new root
    plan, seen = [], []
    for path in [p for p in SYSTEM_DIRS if os.path.lexists(p)] + sorted(readonly, key=len):
        if any(path == b or path.startswith(b.rstrip("/") + "/") for b in seen):
            continue
        seen.append(path)
        if os.path.islink(path):                          # e.g. /lib -> usr/lib on merged-/usr systems
            plan.append(("link", os.readlink(path), "." + path, 0))
        else:
            plan.append(("dir", os.open(path, os.O_PATH | os.O_DIRECTORY), "." + path, _remount_flags(path)))
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            plan.append(("device", os.open(f"/dev/{name}", os.O_PATH), f"./dev/{name}", 0))
    os.setresgid(gid, gid, gid)   # the capabilities of the namespace stay until drop_privileges
    os.setresuid(uid, uid, uid)
    for kind, source, target, flags in plan:
        os.makedirs(os.path.dirname(target) if kind != "dir" else target, exist_ok=True)
        if kind == "link":
            os.symlink(source, target)
            continue
        if kind == "device":
            open(target, "w").close()
        mount(f"/proc/self/fd/{source}", target, None, MS_BIND | (MS_REC if kind == "dir" else 0))
        os.close(source)
        if flags:
            mount(None, target, None, flags)
    os.mkdir("./work")
    mount("tmpfs", "./work", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={work_mb}m,nr_inodes=10000,mode=0700,uid={uid},gid={gid}")
    os.chroot(".")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def drop_privileges() -> None:
    drop_capabilities()
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")   # no ptrace into the supervisor


# -- one snippet ----------------------------------------------------------------------------------------------
def run_child(code: str, s: dict, work: str, out: int) -> None:
    """The forked child: limits, an empty directory and environment, then the code. Never returns."""
    status = 1
    try:
        os.setsid()
        os.dup2(out, 1)
        os.dup2(out, 2)
        try:
            os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
        except OSError:
            os.close(0)
        os.closerange(3, 1 << 16)
        cpu, mb = s["cpu_s"], 1 << 20
        for res, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, s["memory_mb"] * mb),
                           (resource.RLIMIT_FSIZE, s["file_mb"] * mb), (resource.RLIMIT_NPROC, s["max_procs"]),
                           (resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, value if isinstance(value, tuple) else (value, value))
        os.chdir(work)
        os.environ.clear()
        os.environ.update({"HOME": work, "TMPDIR": work, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"})
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.stdout.reconfigure(line_buffering=True)   # printed lines and tracebacks in the order they happened
        sys.path.extend(s["import_paths"])
        sys.argv = [SNIPPET]
        status = 0
        exec(compile(code, SNIPPET, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001 - the model's error is its output
        status = 1
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != SNIPPET:  # show the model its frames only
            tb = tb.tb_next
        try:
            traceback.print_exception(type(exc), exc, tb)
        except BaseException:  # noqa: BLE001
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001
                pass
        os._exit(status & 0xFF)


def empty(root: str) -> None:
    """Remove everything under `root` (code may write beside its own directory, e.g. /work/x, or fill the tmpfs)."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


def run_snippet(code: str, s: dict, work: str, pid_one: bool) -> dict:
    os.mkdir(work, 0o700)
    r, w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        run_child(code, s, work, w)
    os.close(w)
    kept, total, status, timed_out, eof = [], 0, None, False, False
    deadline = start + s["timeout_s"]
    limit = s["max_output_bytes"]
    while True:
        if status is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
                deadline = min(deadline, time.monotonic() + DRAIN_S)   # what it started may not write on and on
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = status is None
            break
        ready = select.select([] if eof else [r], [], [], 0 if status is not None else min(left, 0.05))[0]
        if ready:
            chunk = os.read(r, 65536)
            if not chunk:
                eof = True
            elif total < limit:
                kept.append(chunk[:limit - total])
            total += len(chunk)
        elif status is not None:
            break                      # exited, and nothing more is waiting in the pipe
        elif eof:
            time.sleep(min(left, 0.02))
    # Nothing the code started may outlive the call: in the PID namespace kill(-1) reaches all of it.
    try:
        if pid_one:
            os.kill(-1, signal.SIGKILL)
        else:
            os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if status is None:
        status = os.waitpid(pid, 0)[1]
    while pid_one:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    os.close(r)
    empty(os.path.dirname(work))   # all of /work, not only this call's directory: nothing reaches the next call
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return {"output": b"".join(kept).decode("utf-8", "replace"), "exit": os.WEXITSTATUS(status) if sig is None else None,
            "signal": signal.Signals(sig).name if sig else None, "timed_out": timed_out, "truncated": total > limit,
            "seconds": time.monotonic() - start}


def serve(s: dict, work_root: str, pid_one: bool) -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # as PID 1 of the namespace, unhandled signals are dropped
    send({"ready": True})
    n = 0
    while True:
        request = receive()
        if request is None:                         # the host is gone: so is everything here
            os._exit(0)
        send(run_snippet(request["code"], s, f"{work_root}/{n}", pid_one))
        n += 1


def main() -> int:
    s = receive()["settings"]
    if not s["isolate"]:
        serve(s, s["host_dir"], pid_one=False)
        return 0
    try:
        if os.geteuid() == 0:
            os.setgroups([])   # root's supplementary groups would stay with the process inside
        _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS),
               "unshare")
    except OSError as exc:
        send({"error": f"cannot create namespaces ({exc})"})
        return 1
    send({"unshared": True})
    if not (receive() or {}).get("mapped"):
        return 1
    pid = os.fork()
    if pid == 0:
        try:
            build_root(s["host_dir"], s["readonly"], s["work_mb"], s["uid"], s["gid"])
            drop_privileges()
        except OSError as exc:
            send({"error": f"cannot build the sandbox ({exc})"})
            os._exit(1)
        serve(s, "/work", pid_one=True)
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)   # let the host see EOF as soon as the supervisor dies
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


if __name__ == "__main__":
    sys.exit(main())
