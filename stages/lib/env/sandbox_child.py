"""The sandbox's child side: started as `python -I sandbox_child.py <json>` by
`stages.lib.env.sandbox`, it isolates itself, then runs the model's `main.py`.

Input: argv[1], a JSON object (`folder`, `report_fd`, `isolation`, `cgroup`, the limits).
Output: the code's stdout and stderr on its own, and on the `report_fd` pipe two JSON lines:
`{"guards": [...], "fallback": reason}` (what is in force) and `{"status": <wait status>}`
(how the model's process ended). Standard library only: it runs before any trust is given.

Three processes: this bootstrap, a leader (pid 1 of a fresh pid namespace when the
kernel's isolation is in force) and the model's process, which the leader forks. When the
leader exits, the kernel kills everything left in its pid namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
import traceback

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


class _MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("set", "clr", "propagation", "userns")]


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def isolate(folder: str) -> list[str]:
    """New user, mount, network and pid namespaces; everything read-only but `folder`."""
    uid, gid = os.geteuid(), os.getegid()
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount private")
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    _check(
        libc.syscall(
            SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)
        ),
        "mount_setattr read-only",
    )
    path = folder.encode()
    _check(libc.mount(path, path, None, MS_BIND, None), "bind folder")
    _check(libc.mount(None, path, None, MS_BIND | MS_REMOUNT, None), "folder read-write")
    return ["user-namespace", "network-namespace", "pid-namespace", "read-only-mounts"]


def drop_privileges() -> None:
    """No capabilities, none to regain: bounding set emptied, no new privileges on exec."""
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last capability
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    _check(libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")


def audit_hook(folder: str):  # type: ignore[no-untyped-def]
    """The fallback guard: refuse sockets, writes outside `folder`, other processes'
    /proc entries, new programs, signals and ctypes, inside this interpreter only."""
    inside = os.path.realpath(folder) + os.sep
    refused = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo"}
    refused |= {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn"}
    refused |= {"os.kill", "os.killpg", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata"}
    refused |= {"os.chroot", "pty.spawn"}
    paths = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.symlink", "os.link"}
    paths |= {"os.truncate", "os.chmod", "os.chown", "os.utime", "shutil.rmtree"}
    own = f"/proc/{os.getpid()}/"

    def outside(path: object) -> bool:
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            return False  # a file descriptor already open
        return not (os.path.realpath(path) + os.sep).startswith(inside)

    def hook(event: str, args: tuple) -> None:  # type: ignore[type-arg]
        if event in refused:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and args:
            path, mode, flags = [*args, None, None][:3]
            writes = bool((flags or 0) & WRITE_FLAGS) or any(c in str(mode or "") for c in "wax+")
            name = os.fsdecode(path) if isinstance(path, (str, bytes)) else ""
            proc = os.path.realpath(name)
            if name and proc.startswith("/proc/") and not proc.startswith(("/proc/self/", own)):
                raise PermissionError(f"sandbox: reading {name} is not allowed")
            if writes and outside(path):
                raise PermissionError(f"sandbox: writing {name} outside the folder")
        elif event in paths and args and any(outside(a) for a in args[:2] if a is not None):
            raise PermissionError(f"sandbox: {event} outside the folder")

    return hook


def _tasks_of(uid: int) -> int:
    """How many tasks (threads) `uid` runs now, as RLIMIT_NPROC counts them."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1 0").split()[1]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def run_code(cfg: dict) -> None:  # type: ignore[type-arg]
    """The model's process: limits, then main.py as __main__; never returns."""
    os.close(cfg["report_fd"])
    mb = 1024 * 1024
    limits = [
        (resource.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1),
        (resource.RLIMIT_AS, cfg["memory_mb"] * mb, cfg["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, cfg["file_mb"] * mb, cfg["file_mb"] * mb),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    if os.geteuid() != 0:  # root's processes are not counted: the pids cgroup counts them
        # counted per user: in our user namespace, the bootstrap and the leader; outside
        # one, every process of this user on the machine
        nproc = cfg["processes"] + (2 if not cfg["hook"] else _tasks_of(os.geteuid()))
        limits.append((resource.RLIMIT_NPROC, nproc, nproc))
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))
    if cfg["hook"]:
        sys.addaudithook(audit_hook(cfg["folder"]))
    sys.argv, code = ["main.py"], 0
    try:
        with open("main.py") as f:
            source = f.read()
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)  # type: ignore[union-attr]
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            code = code or 1
    os._exit(code)


def lead(cfg: dict, kernel: bool) -> None:  # type: ignore[type-arg]
    """The leader: its own /proc, no privileges, then the model's process; reports its end."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if kernel:
        # hides every process outside; refused where /proc is partly masked (containers)
        with contextlib.suppress(OSError):
            _check(libc.mount(b"proc", b"/proc", b"proc", 0, None), "mount proc")
    drop_privileges()
    child = os.fork()
    if child == 0:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        run_code(cfg)
    while True:  # reap orphans too, until the model's process ends
        pid, status = os.wait()
        if pid == child:
            break
    os.write(cfg["report_fd"], (json.dumps({"status": status}) + "\n").encode())
    os._exit(0)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    guards, fallback = ["rlimits", "empty-environment"], None
    if cfg["cgroup"]:
        _write(os.path.join(cfg["cgroup"], "cgroup.procs"), "0")
        guards.append("pids-cgroup")
    kernel = False
    if cfg["isolation"] == "auto":
        try:
            guards += isolate(cfg["folder"])
            kernel = True
        except OSError as exc:
            fallback = str(exc)
    else:
        fallback = "isolation 'hook' asked for"
    cfg["hook"] = not kernel
    if not kernel:
        guards.append("audit-hook")
    guards.append("no-capabilities")
    report = json.dumps({"guards": guards, "fallback": fallback}) + "\n"
    os.write(cfg["report_fd"], report.encode())
    os.chdir(cfg["folder"])
    leader = os.fork()
    if leader == 0:
        lead(cfg, kernel)
    _, status = os.waitpid(leader, 0)
    os._exit(0 if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
