"""Launch the training ranks as fresh processes and follow them.

Input: the rank module to run (e.g. `stages.train.worker`), its brief file,
which ranks of the job to start here (`Ranks`: all of them, or this node's
share of a job that spans nodes), the device kind, threads per rank, a log
file, a logger, and optionally a `should_stop` callback (another node failed).
Output: returns when every rank exited 0; otherwise stops the others and
raises `TrainingFailed` with the exit status and the last lines of the log.

Each rank is `python -m MODULE BRIEF` with the usual
torch.distributed environment (MASTER_ADDR and MASTER_PORT of global rank 0:
127.0.0.1 and a free port for a one-node job; RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, NODE_RANK), `CUDA_VISIBLE_DEVICES` set to the node's devices
when the stage holds some (rank `LOCAL_RANK` uses the LOCAL_RANK-th of them),
OMP_NUM_THREADS set to its share of the cores, and `DS_ACCELERATOR=cpu` on CPU
so DeepSpeed does not probe for GPUs. Every
output line goes to the log file with its rank; the worker's own log records
(marked `@pipe LEVEL`) also go to the stage's logger at their level, so the
stage log shows progress without library noise.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from stages.lib.distributed.rank import MARK, PARENT_ENV
from stages.lib.net import free_port

if TYPE_CHECKING:
    from engine.stage import StageContext

TAIL_LINES = 40


class TrainingFailed(RuntimeError):
    """A training rank exited with a non-zero status."""


@dataclass(frozen=True)
class Ranks:
    """The ranks of one torch.distributed job this process starts, and where rank 0 listens."""

    world: int
    first: int = 0  # global rank of the first rank started here
    local: int | None = None  # ranks started here (default: all of them)
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port of this machine
    devices: tuple[str, ...] = ()  # this node's CUDA_VISIBLE_DEVICES names (empty: unchanged)
    env: tuple[tuple[str, str], ...] = ()  # more variables for every rank (e.g. its node's name)

    @property
    def count(self) -> int:
        return self.world if self.local is None else self.local


MALLOC_TRIM_THRESHOLD = 65536


def rank_table(ctx: StageContext, role: str | None = None) -> list[dict[str, Any]]:
    """Every rank of a job placed on the stage's slots (of `role` only, when given): one per
    device, numbered task by task (the first task holding devices has ranks 0..n-1, and so
    on), each with its node rank among those tasks, local rank, node, worker and device."""
    out: list[dict[str, Any]] = []
    node_rank = -1
    for node, worker in ctx.tasks:
        devices = sorted(
            {
                d
                for s in ctx.slots
                if (role is None or s.role == role) and (s.node, s.worker) == (node, worker)
                for d in s.devices
            }
        )
        if not devices:
            continue
        node_rank += 1
        for local, device in enumerate(devices):
            out.append(
                {
                    "rank": len(out),
                    "node_rank": node_rank,
                    "local_rank": local,
                    "node": node,
                    "worker": worker,
                    "device": device,
                }
            )
    return out


def rank_env(
    rank: int, ranks: Ranks, port: int, threads: int, device: str, local: int = 0
) -> dict[str, str]:
    """The environment of global rank `rank` (the `local`-th started here): this process's,
    plus the distributed settings."""
    root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    if ranks.devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ranks.devices)
    env.update(ranks.env)
    env.update(
        MASTER_ADDR=ranks.master_addr,
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(local),
        WORLD_SIZE=str(ranks.world),
        LOCAL_WORLD_SIZE=str(ranks.count),
        NODE_RANK=str(ranks.node_rank),
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p),
        **{PARENT_ENV: str(os.getpid())},  # a rank exits when this process dies
    )
    # glibc keeps freed tensors in its heaps and grows them step after step under ZeRO-3's
    # gather/release pattern; setting a trim threshold also fixes the mmap threshold (no
    # dynamic raise), so large tensors go back to the OS when freed (Dask's workers do the same)
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(MALLOC_TRIM_THRESHOLD))
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class _Follower(threading.Thread):
    """Copies one rank's output to the log file (and rank 0's to the logger)."""

    def __init__(
        self,
        rank: int,
        stream: IO[str],
        sink: IO[str],
        lock: threading.Lock,
        logger: logging.Logger,
        tail: deque[str],
    ):
        super().__init__(daemon=True)
        self.rank, self.stream, self.sink, self.lock = rank, stream, sink, lock
        self.logger, self.tail = logger, tail

    def run(self) -> None:
        for raw in self.stream:
            line = raw.rstrip("\n")
            shown = f"[rank {self.rank}] {line.removeprefix(MARK)}"
            with self.lock:
                self.sink.write(shown + "\n")
                self.sink.flush()
                self.tail.append(shown)
            if line.startswith(MARK):
                level, _, message = line[len(MARK) :].partition(" ")
                prefix = f"rank {self.rank}: " if self.rank else ""
                number = getattr(logging, level, logging.INFO)
                self.logger.log(
                    number if isinstance(number, int) else logging.INFO, "%s%s", prefix, message
                )


def _stop(procs: list[subprocess.Popen[str]], grace_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(
    module: str,
    brief_path: str,
    ranks: Ranks,
    device: str,
    threads: int,
    log_path: str,
    logger: logging.Logger,
    should_stop: Callable[[], str | None] | None = None,
) -> None:
    """Run this node's ranks of `python -m module brief_path`; raise if any fails, or (killing
    them) when `should_stop` returns a reason."""
    port = ranks.master_port or free_port()
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    lock = threading.Lock()
    procs: list[subprocess.Popen[str]] = []
    followers: list[_Follower] = []
    failed: tuple[int, int] | str | None = None
    with open(log_path, "a", encoding="utf-8") as sink:
        try:
            for local in range(ranks.count):
                rank = ranks.first + local
                proc = subprocess.Popen(
                    [sys.executable, "-m", module, brief_path],
                    env=rank_env(rank, ranks, port, threads, device, local),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    bufsize=1,
                )
                procs.append(proc)
                assert proc.stdout is not None
                followers.append(_Follower(rank, proc.stdout, sink, lock, logger, tail))
                followers[-1].start()
            failed = _wait(procs, should_stop, ranks.first)
        finally:
            _stop(procs)
            for f in followers:
                f.join(timeout=5)
    if isinstance(failed, str):
        raise TrainingFailed(
            f"ranks {ranks.first}-{ranks.first + ranks.count - 1} stopped: {failed}"
        )
    if failed is not None:
        rank, code = failed
        lines = "\n".join(tail)
        raise TrainingFailed(
            f"training rank {rank} {_describe(code)}; last lines of {log_path}:\n{lines}"
        )


def _wait(
    procs: list[subprocess.Popen[str]], should_stop: Callable[[], str | None] | None, first: int
) -> tuple[int, int] | str | None:
    """Wait for every rank: the first to fail (global rank, status), the reason `should_stop`
    gave (checked every second), or None when all exit 0."""
    checked = time.monotonic()
    while True:
        codes = [p.poll() for p in procs]
        for i, code in enumerate(codes):
            if code is not None and code != 0:
                return first + i, code
        if all(code == 0 for code in codes):
            return None
        if should_stop is not None and time.monotonic() - checked > 1.0:
            checked = time.monotonic()
            reason = should_stop()
            if reason is not None:
                return reason
        time.sleep(0.1)
