"""Environments served by a process the stage starts: verifiers' tasksets, from their own venv.

Input: an `EnvironmentConfig` of a served kind (`verifiers`: `env_id`, `config`). Output: a
`Served`, ready: a function making one `HTTPEnvironment` per episode against the process,
which `close()` stops (the stage's `environments` context does, on success, failure and
Ctrl-C).

verifiers' dependencies are pinned apart from pipe's, so its environments run in
`.venv-verifiers` (`make install-verifiers`; `$PIPE_VERIFIERS_PYTHON` names another
interpreter) behind pipe's HTTP environment protocol: the bridge
(`stages/lib/env/verifiers_bridge.py`, run by path with `-P` so it imports nothing of pipe)
loads the taskset, binds 127.0.0.1 on a free port and prints `ready <port>`. The stage waits
for that line (bounded by `start_timeout_s`), talks to it over HTTP, and stops it by its PID:
SIGTERM, then SIGKILL after a grace period. A stage killed outright takes it along: the
kernel sends it SIGTERM when its parent dies (Linux), and the bridge exits when its parent
is gone.
"""

from __future__ import annotations

import collections
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from stages.lib.env import verifiers_bridge  # its source: part of the kinds' code version
from stages.lib.env.builtin import HTTPEnvironment
from stages.lib.env.field import EnvironmentConfig

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]
BRIDGE = Path(verifiers_bridge.__file__)  # run by path in verifiers' venv, never imported there
PYTHON_ENV = "PIPE_VERIFIERS_PYTHON"
START_TIMEOUT_S = 180.0  # importing verifiers takes 10-30 s on a loaded machine
STOP_GRACE_S = 5.0


def verifiers_python() -> str:
    """The interpreter with verifiers: `$PIPE_VERIFIERS_PYTHON`, else `.venv-verifiers`."""
    configured = os.environ.get(PYTHON_ENV)
    if configured:
        return configured
    venv = REPO / ".venv-verifiers" / "bin" / "python"
    if not venv.exists():
        raise RuntimeError(
            f"environment kind 'verifiers' runs in verifiers' own venv, and "
            f"{venv.parent.parent} is missing: run `make install-verifiers` (or set "
            f"${PYTHON_ENV} to an interpreter with verifiers 0.4.0)"
        )
    return str(venv)


def bridge_command(cfg: EnvironmentConfig, python: str) -> list[str]:
    """The bridge's command line for the block's taskset and config."""
    assert cfg.env_id is not None
    config = json.dumps(cfg.config)
    return [python, "-P", str(BRIDGE), "--env-id", cfg.env_id, "--config", config]


def _death_signal() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Served:
    """A running bridge: `served()` makes an episode's environment; `close()` stops it."""

    def __init__(self, cfg: EnvironmentConfig, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.cfg = cfg
        cmd = bridge_command(cfg, verifiers_python())
        env = dict(os.environ)  # the taskset's module is found from the working directory too
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), os.getcwd()) if p)
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            preexec_fn=_death_signal(),
        )
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        log.info("verifiers: starting the bridge for '%s' (pid %d)", cfg.env_id, self.proc.pid)
        try:
            self.url = f"http://127.0.0.1:{self._ready(start_timeout_s)}"
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self._pump, name="verifiers-log", daemon=True).start()
        log.info("verifiers: '%s' served at %s", cfg.env_id, self.url)

    def _ready(self, timeout_s: float) -> int:
        """The port of the bridge's `ready <port>` line; its output before it is kept."""
        assert self.proc.stdout is not None
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(self._until_ready()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if lines and lines[-1].startswith("ready "):
            return int(lines[-1].split()[1])
        if reader.is_alive():
            status = f"not ready after {timeout_s:g} s"
        else:  # its output ended: it exited, or is exiting
            try:
                status = f"exited with code {self.proc.wait(STOP_GRACE_S)}"
            except subprocess.TimeoutExpired:
                status = "closed its output without a ready line"
        tail = "\n".join(self.tail)
        raise RuntimeError(
            f"verifiers bridge for '{self.cfg.env_id}' {status}; its last lines:\n{tail}"
        )

    def _until_ready(self) -> list[str]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if line.startswith("ready "):
                return [line]
            self.tail.append(line)
            log.debug("verifiers: %s", line)
        return []

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            log.debug("verifiers: %s", line.rstrip("\n"))

    def __call__(self) -> HTTPEnvironment:
        return HTTPEnvironment(self.url, self.cfg.timeout_s)

    def close(self) -> None:
        """Stop the bridge by its PID: SIGTERM, SIGKILL after a grace period."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            log.info("verifiers: the bridge (pid %d) stopped", self.proc.pid)


def served(cfg: EnvironmentConfig) -> Served | None:
    """The running process for a served kind (None for the others)."""
    return Served(cfg) if cfg.kind == "verifiers" else None
