"""One vLLM server process: started in its own process group, its output pumped to a log
file, waited on until healthy, stopped with its whole group.

Input: a command line and an environment (`stages.lib.backends.vllm.server` builds both), the
address it binds, the secret its health check presents. Output: a `ServerProcess` (its
`url`, its log's last lines), healthy or a RuntimeError naming the log and quoting it.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from stages.lib.backends.vllm.auth import bearer

HOST = "127.0.0.1"
STOP_GRACE_S = 15.0
POLL_S = 0.5
TAIL_LINES = 40
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@dataclass
class ServerProcess:
    """One running server: its process, its log file, and the last lines it printed."""

    proc: subprocess.Popen[str]
    port: int
    log_path: Path
    host: str = HOST
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES)
    )
    pump: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"{self.origin}/v1"

    @property
    def origin(self) -> str:
        """`http://host:port`, an IPv6 address in brackets."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def last_lines(self) -> str:
        return "\n".join(self.tail.copy())


def _pump(stream: IO[str], sink: IO[str], server: ServerProcess, log: logging.Logger) -> None:
    """Copy the server's output to its log file, the tail buffer and `log`."""
    with sink:
        for line in stream:
            sink.write(line)
            sink.flush()
            text = line.rstrip("\n")
            server.tail.append(text)
            log.debug("vllm:%d: %s", server.port, text)


def _term_with_parent() -> Callable[[], None] | None:
    """On Linux, a hook that has the kernel SIGTERM the server when its parent dies.

    A stage killed with SIGKILL (OOM killer, preemption) cannot stop its server,
    which would otherwise keep its GPUs and port. The signal comes when the thread
    that started the server ends, so the `vllm_server` context must stay in one
    thread (it does in a stage). libc is loaded here, before the fork, so the child
    only makes the one call.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def set_death_signal() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return set_death_signal


def start_server(
    cmd: Sequence[str],
    env: Mapping[str, str],
    *,
    port: int,
    log_path: Path,
    log: logging.Logger,
    host: str = HOST,
) -> ServerProcess:
    """Start the server in its own process group; its output is pumped by a thread.

    The command line is logged at DEBUG, the environment (which holds the secret) never.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sink = log_path.open("w", encoding="utf-8")
    log.info("starting vLLM on %s:%d (log %s)", host, port, log_path)
    log.debug("vLLM command: %s", " ".join(cmd))
    proc = subprocess.Popen(
        list(cmd),
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
        preexec_fn=_term_with_parent(),
    )
    server = ServerProcess(proc, port, log_path, host)
    assert proc.stdout is not None
    server.pump = threading.Thread(
        target=_pump, args=(proc.stdout, sink, server, log), name=f"vllm-log-{port}", daemon=True
    )
    server.pump.start()
    return server


def _healthy(server: ServerProcess, secret: str) -> bool:
    """Whether the server answers `GET /health` with 200 to the bearer of `secret`: a
    server started with another secret (someone else's, on a reused port) answers 401."""
    request = urllib.request.Request(f"{server.origin}/health", headers=bearer(secret))
    try:
        with urllib.request.urlopen(request, timeout=POLL_S * 4) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(
    server: ServerProcess,
    timeout_s: float,
    log: logging.Logger,
    *,
    secret: str,
    since: float | None = None,
) -> float:
    """Wait for `GET /health`; return the seconds since `since` (default now), or raise.

    The error names the log file and quotes its last lines.
    """
    start = time.monotonic() if since is None else since
    while True:
        code = server.proc.poll()
        if code is not None:
            if server.pump is not None:
                server.pump.join(timeout=5)
            raise RuntimeError(
                f"vLLM server on port {server.port} exited with code {code} before becoming "
                f"healthy; last lines of {server.log_path}:\n{server.last_lines()}"
            )
        if _healthy(server, secret):
            elapsed = time.monotonic() - start
            log.info("vLLM healthy at %s after %.1f s", server.url, elapsed)
            return elapsed
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(
                f"vLLM server on port {server.port} not healthy after {timeout_s:g} s "
                f"(startup_timeout_s); last lines of {server.log_path}:\n{server.last_lines()}"
            )
        time.sleep(POLL_S)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def stop_server(server: ServerProcess, log: logging.Logger, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after `grace_s`."""
    pgid = server.proc.pid  # the leader of its own session and group
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    try:
        server.proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        log.warning("vLLM on port %d ignored SIGTERM for %g s: killing it", server.port, grace_s)
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)  # engine core and workers shutting down
    if _group_alive(pgid):
        _signal_group(pgid, signal.SIGKILL)
    server.proc.wait()
    if server.pump is not None:
        server.pump.join(timeout=5)
    log.info("vLLM on port %d stopped (exit code %s)", server.port, server.proc.returncode)
