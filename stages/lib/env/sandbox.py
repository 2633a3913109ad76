"""Run model-written Python in a throw-away subprocess with limits: the `python` tool's sandbox.

Input: the code (a string) and `Limits`. Output: a `Result` (stdout, stderr, exit code, which
limit ended it, seconds, and the guards that were in force). The code's misbehaviour never
raises: a fork bomb, an endless loop, a huge allocation or an escape attempt comes back as
a `Result` with an `error`.

Each run gets a fresh temporary folder (its working directory, removed afterwards) and a
fresh interpreter (`python -I`: no PYTHON* variables, no user site; the venv's packages
import). The child side is `stages.lib.env.sandbox_child`. What each guard does:

- **Environment**: the child starts with an empty environment (bar OMP/OpenBLAS threads = 1),
  so API keys in ours are not in its `os.environ`. Our `/proc/<pid>/environ` is out of its
  reach: in a user namespace the kernel refuses it (and a fresh /proc hides our processes);
  as root the child has no capabilities, which the kernel also refuses; the fallback hook
  refuses opening any other process's /proc entries.
- **CPU** (`RLIMIT_CPU`): a busy loop gets SIGXCPU after `cpu_s` seconds of CPU.
  **Wall clock**: `wall_s` covers sleeping and blocking; the process group is killed.
- **Memory** (`RLIMIT_AS`, per process): a big allocation raises MemoryError. Each forked
  process has its own budget; a cgroup's memory limit would bound the sum (not used).
- **Processes**: root's processes are exempt from `RLIMIT_NPROC`, so as root a pids cgroup
  caps the tasks (threads count); otherwise `RLIMIT_NPROC`, per sandbox inside its user
  namespace, or counted on top of the user's current tasks without one. Whatever the cap,
  the run ends with the leader of its pid namespace, and the kernel kills what is left.
- **Output**: stdout and stderr together are cut at `output_bytes`, and the run is
  killed when it passes that. **File size** (`RLIMIT_FSIZE`): no file over `file_mb`.
- **Network and writes**, kernel isolation when it is available (root, or unprivileged user
  namespaces): new user, network, mount and pid namespaces; the network namespace has only
  a loopback that is down, and every mount is read-only except the folder. When namespaces
  are refused (a container without CAP_SYS_ADMIN, Ubuntu's AppArmor restriction), the
  fallback is an audit hook (PEP 578) in the child's interpreter: it refuses sockets,
  writes outside the folder, other processes' /proc, subprocesses, signals and ctypes.
- **Privileges**: the child drops every capability (and the bounding set) and sets
  no_new_privs, so a setuid program gives none back.

`Result.guards` names the guards in force and `Result.fallback` why the kernel's were not.
This is not a security boundary against a determined attacker the way a container, gVisor or
a VM is: the kernel is shared (a kernel bug is an escape), the audit hook can be defeated by
code that finds a way around the interpreter's events, files the user can read stay
readable (read-only is not hidden), and disk use in the folder is bounded only per file. It
stops a model's accidents and casual escapes, which is what an RL environment meets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

CHILD = str(Path(__file__).with_name("sandbox_child.py"))
ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
HELPERS = 3  # the bootstrap, the leader and the model's first process, in the pids cgroup


@dataclass(frozen=True)
class Limits:
    """What one run may use (see the module docstring for what each guards against)."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 1024
    processes: int = 16
    output_bytes: int = 16_384
    file_mb: int = 16
    isolation: Literal["auto", "hook"] = "auto"  # hook: the fallback even where namespaces work


@dataclass(frozen=True)
class Result:
    """How a run went. `error`: None, or the limit that ended it: timeout | cpu | memory |
    processes | output | killed (by a signal). Code that fails on its own (an exception, a
    refused write) has a non-zero `exit_code` and no `error`."""

    stdout: str
    stderr: str
    exit_code: int
    error: str | None
    seconds: float
    guards: tuple[str, ...] = ()
    fallback: str | None = None
    folder: str = ""  # where it ran (removed by now)

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0


def _pids_cgroup(limit: int) -> str | None:
    """A fresh pids cgroup capped at `limit` tasks, where we may make one (root), else None."""
    if os.geteuid() != 0:
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            enabled = base / "cgroup.subtree_control"
            if not (enabled.is_file() and "pids" in enabled.read_text().split()):
                continue
        elif "pids" in controllers.split(","):
            base = Path("/sys/fs/cgroup/pids") / path.lstrip("/")
        else:
            continue
        group = base / f"pipe-sandbox-{uuid.uuid4().hex[:12]}"
        try:
            group.mkdir()
            (group / "pids.max").write_text(str(limit))
        except OSError:
            with contextlib.suppress(OSError):
                group.rmdir()
            continue
        return str(group)
    return None


def _kill_cgroup(group: str) -> None:
    with contextlib.suppress(OSError):
        for pid in Path(group, "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)


def _remove_cgroup(group: str) -> None:
    """Kill what is left in it and remove it (a member not yet reaped keeps it busy)."""
    for _ in range(100):
        _kill_cgroup(group)
        with contextlib.suppress(OSError):
            os.rmdir(group)
            return
        time.sleep(0.01)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


class _Capture:
    """stdout and stderr, kept together up to `cap` bytes; `over` is set past it."""

    def __init__(self, cap: int) -> None:
        self.cap, self.kept, self.over = cap, 0, asyncio.Event()

    async def read(self, stream: asyncio.StreamReader, out: bytearray) -> None:
        while chunk := await stream.read(65536):
            room = max(self.cap - self.kept, 0)
            out += chunk[:room]
            self.kept += min(room, len(chunk))
            if len(chunk) > room:
                self.over.set()


def _report(fd: int) -> dict[str, Any]:
    """The child's report lines, merged (its guards, then the model's wait status)."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, 65536):
            data += chunk
    os.close(fd)
    merged: dict[str, Any] = {}
    for line in data.decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            merged.update(json.loads(line))
    return merged


def _verdict(
    status: int | None, returncode: int | None, stderr: str, cause: str | None
) -> tuple[int, str | None]:
    """The exit code (minus a signal's number when one killed it) and the limit that ended it."""
    if status is None:
        code = returncode if returncode is not None else -signal.SIGKILL
    elif os.WIFSIGNALED(status):
        code = -os.WTERMSIG(status)
    else:
        code = os.WEXITSTATUS(status)
    if cause:
        return code, cause
    if code == -signal.SIGXCPU:
        return code, "cpu"
    tail = stderr[-2000:]
    if code != 0 and "MemoryError" in tail:
        return code, "memory"
    if code != 0 and "BlockingIOError: [Errno 11]" in tail:
        return code, "processes"  # fork or a thread refused: the task cap
    if code < 0 or status is None:
        return code, "killed"
    return code, None


async def run_python_async(code: str, limits: Limits = Limits()) -> Result:
    """Run `code` as a fresh `main.py` under `limits` (module docstring); never raises for it."""
    start = time.monotonic()
    folder = tempfile.mkdtemp(prefix="pipe-sandbox-")
    Path(folder, "main.py").write_text(code)
    group = _pids_cgroup(limits.processes + HELPERS)
    read_fd, write_fd = os.pipe()
    cfg = {
        "folder": folder,
        "report_fd": write_fd,
        "isolation": limits.isolation,
        "cgroup": group,
        "cpu_s": limits.cpu_s,
        "memory_mb": limits.memory_mb,
        "file_mb": limits.file_mb,
        "processes": limits.processes,
    }
    out, err, capture = bytearray(), bytearray(), _Capture(limits.output_bytes)
    cause: str | None = None
    try:
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-I", CHILD, json.dumps(cfg)),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=ENV,
            cwd=folder,
            start_new_session=True,
            pass_fds=(write_fd,),
        )
        os.close(write_fd)
        assert proc.stdout is not None and proc.stderr is not None
        readers = [
            asyncio.ensure_future(capture.read(stream, buf))
            for stream, buf in ((proc.stdout, out), (proc.stderr, err))
        ]
        ended = asyncio.ensure_future(proc.wait())
        cut = asyncio.ensure_future(capture.over.wait())
        done, _ = await asyncio.wait(
            {ended, cut}, timeout=limits.wall_s, return_when="FIRST_COMPLETED"
        )
        if ended not in done:
            cause = "output" if cut in done else "timeout"
        _kill_group(proc.pid)
        if group:
            _kill_cgroup(group)
        await asyncio.wait({ended, *readers}, timeout=1.0)
        for task in (ended, cut, *readers):
            task.cancel()
        report = _report(read_fd)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if group:
            _remove_cgroup(group)
    stderr = err.decode(errors="replace")
    exit_code, error = _verdict(report.get("status"), proc.returncode, stderr, cause)
    return Result(
        stdout=out.decode(errors="replace"),
        stderr=stderr,
        exit_code=exit_code,
        error=error,
        seconds=round(time.monotonic() - start, 3),
        guards=tuple(report.get("guards", ())),
        fallback=report.get("fallback"),
        folder=folder,
    )


def run_python(code: str, limits: Limits = Limits()) -> Result:
    """`run_python_async`, from synchronous code (in a thread of its own under a running loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_python_async(code, limits))
    box: list[Result] = []
    thread = threading.Thread(
        target=lambda: box.append(asyncio.run(run_python_async(code, limits)))
    )
    thread.start()
    thread.join()
    return box[0]
