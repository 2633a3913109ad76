"""What a stage uses: CPU, memory and its GPUs, sampled on the worker while the stage runs.

Input: the stage's folder, the worker's name, the GPUs the stage holds on this worker (its
slots' device ids) and, at the edge, a `GpuReader` (NVML through `nvidia-ml-py` where there
is a GPU and the library; none otherwise, or one a test injects). Output: rows appended to
`<stage_dir>/usage.jsonl` (`usage.<task>.jsonl` for the other tasks of a stage placed on
several workers, as their logs), one per sample, and, per GPU, one more:
`{"time", "worker", "cpu_util", "rss_gb"}` plus `"gpu", "gpu_util", "gpu_mem_gb"` on GPU rows;
the same figures as metric events in `track.jsonl` for the trackers (`usage/...`, the step
the sample's number); and the summary (`engine.run.usage_summary`) the task adds to the
stage's metrics under `"usage"`.

What is measured: the worker process and every process it started (training ranks, vLLM
servers, collect shards), the way `top` counts them: `cpu_util` in percent of one core (200
is two busy cores), `rss_gb` their resident memory summed. Two stages sharing a worker at
once (a CPU stage beside another) both see the worker's whole use. A sample every
`PIPE_USAGE_INTERVAL_S` seconds (2 by default) and one at the end, so a stage shorter than
the interval still writes its row. The sampler is a daemon thread that
sleeps between samples; its cost is measured by `bench/usage_sampler.py` (BENCHMARKS.md).
A sampler that fails stops itself with one warning in the stage's log: it never fails a
stage. A stage folder on remote storage (`s3://...`) gets its rows once, at the end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from engine.fsio import atomic_write_text

log = logging.getLogger("pipe.usage")
USAGE = "usage.jsonl"
EVENTS = "track.jsonl"  # stages.lib.io.metrics.EVENTS, what the trackers tail
INTERVAL_S = 2.0
GB = 1024**3


class GpuReader(Protocol):
    """Utilisation (%) and memory used (GB) of each GPU a stage holds, read at the edge."""

    def read(self) -> list[tuple[int, float, float]]: ...  # (device id, util %, memory GB)
    def close(self) -> None: ...


class NvmlReader:
    """`GpuReader` over NVML (`pynvml`, from `nvidia-ml-py`): device ids as NVML indexes them,
    which are the ids the placement gives (a worker's `CUDA_VISIBLE_DEVICES` entries)."""

    def __init__(self, devices: Sequence[int]) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handles = [(d, pynvml.nvmlDeviceGetHandleByIndex(d)) for d in devices]

    def read(self) -> list[tuple[int, float, float]]:
        out = []
        for device, handle in self.handles:
            util = self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu
            used = self.nvml.nvmlDeviceGetMemoryInfo(handle).used
            out.append((device, float(util), used / GB))
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()


def nvml_reader(devices: Sequence[int]) -> GpuReader | None:
    """An `NvmlReader` for `devices`; None without devices, without `nvidia-ml-py`, or where
    NVML does not start (no driver): the rows then carry CPU and memory only."""
    if not devices:
        return None
    try:
        return NvmlReader(devices)
    except Exception as exc:  # ImportError, NVMLError: no GPU figures, the stage goes on
        log.info("usage: no GPU figures (%s: %s)", type(exc).__name__, exc)
        return None


class Sampler:
    """Samples the process tree (and the reader's GPUs) into rows; `start` runs it on a thread."""

    def __init__(
        self,
        worker: str,
        gpus: GpuReader | None = None,
        interval_s: float = INTERVAL_S,
        usage_path: str | None = None,
        events_path: str | None = None,
    ) -> None:
        import psutil

        self.psutil = psutil
        self.worker, self.gpus, self.interval_s = worker, gpus, interval_s
        self.usage_path, self.events_path = usage_path, events_path
        self.me = psutil.Process()
        self.procs: dict[int, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.samples = 0
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self.me.cpu_percent(None)  # the baseline: psutil measures CPU between two calls
        self.procs = {self.me.pid: self.me}

    def _descendants(self) -> list[int]:
        """The pids under this process: Linux's `/proc/PID/task/TID/children` walked from
        here (the cost follows the tree), else psutil's scan of every process."""
        found: list[int] = []
        todo = [self.me.pid]
        try:
            while todo:
                pid = todo.pop()
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(FileNotFoundError):  # a thread that just ended
                        with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                            kids = [int(k) for k in f.read().split()]
                        found.extend(kids)
                        todo.extend(kids)
            return found
        except OSError:  # not Linux, or a kernel without the children files
            with contextlib.suppress(self.psutil.Error):
                return [c.pid for c in self.me.children(recursive=True)]
            return []

    def _cpu(self) -> tuple[float, float]:
        """CPU % of one core and RSS (GB) of this process and its descendants. A process seen
        for the first time counts its CPU time since it started (psutil measures between
        two calls)."""
        cpu = rss = 0.0
        procs = {self.me.pid: self.me}
        for pid in self._descendants():
            proc = self.procs.get(pid)
            if proc is None:
                with contextlib.suppress(self.psutil.Error):
                    proc = self.psutil.Process(pid)
                    times = proc.cpu_times()
                    age = max(time.time() - proc.create_time(), 1e-3)
                    cpu += 100.0 * (times.user + times.system) / age
            if proc is not None:
                procs[pid] = proc
        for pid, proc in procs.items():
            with contextlib.suppress(self.psutil.Error):
                used = proc.cpu_percent(None)
                cpu += used if pid in self.procs else 0.0
                rss += proc.memory_info().rss
        self.procs = procs
        return cpu, rss / GB

    def sample(self) -> list[dict[str, Any]]:
        """One sample: a CPU row, then one row per GPU; appended to the files when local."""
        cpu, rss = self._cpu()
        now = round(time.time(), 3)
        row: dict[str, Any] = {"time": now, "worker": self.worker}
        rows = [{**row, "cpu_util": round(cpu, 1), "rss_gb": round(rss, 4)}]
        values = {"usage/cpu_util": cpu, "usage/rss_gb": rss}
        for device, util, mem in self.gpus.read() if self.gpus is not None else []:
            rows.append({**rows[0], "gpu": device, "gpu_util": util, "gpu_mem_gb": round(mem, 4)})
            values[f"usage/gpu{device}_util"] = util
            values[f"usage/gpu{device}_mem_gb"] = round(mem, 4)
        self.rows.extend(rows)
        event = {"step": self.samples, "t": now, "metrics": values}
        self.samples += 1
        _append(self.usage_path, [json.dumps(r) for r in rows])
        _append(self.events_path, [json.dumps(event)])
        return rows

    def _loop(self) -> None:
        try:
            while not self.stopped.wait(self.interval_s):
                self.sample()
        except Exception as exc:  # a sampler's failure never fails the stage
            log.warning(
                "usage: sampling stopped (%s: %s); the stage goes on", type(exc).__name__, exc
            )

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="pipe-usage", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """End the thread and take the last sample."""
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()
        try:
            self.sample()
        finally:
            if self.gpus is not None:
                self.gpus.close()


def _append(path: str | None, lines: list[str]) -> None:
    """Lines appended with one `write` (O_APPEND): concurrent writers never interleave a line."""
    if path is None or not lines:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, ("\n".join(lines) + "\n").encode())
    finally:
        os.close(fd)


def usage_name(task: int) -> str:
    return USAGE if task == 0 else f"usage.{task}.jsonl"


@contextlib.contextmanager
def sampling(
    stage_dir: str,
    worker: str,
    devices: Sequence[int] = (),
    task: int = 0,
    reader: GpuReader | None = None,
    interval_s: float | None = None,
) -> Iterator[Sampler | None]:
    """Sample while the body runs; the `Sampler` (its rows) or None where psutil is missing or
    the sampler could not start. `reader` replaces NVML (tests inject one at this edge)."""
    local = "://" not in stage_dir
    usage = f"{stage_dir.rstrip('/')}/{usage_name(task)}"
    if interval_s is None:
        interval_s = float(os.environ.get("PIPE_USAGE_INTERVAL_S", INTERVAL_S))
    sampler: Sampler | None = None
    try:
        if local:
            with contextlib.suppress(FileNotFoundError):
                os.remove(usage)  # a retried attempt starts its own rows
        gpus = reader if reader is not None else nvml_reader(devices)
        sampler = Sampler(
            worker,
            gpus,
            interval_s,
            usage_path=usage if local else None,
            events_path=f"{stage_dir.rstrip('/')}/{EVENTS}" if local else None,
        )
        sampler.start()
    except Exception as exc:
        log.warning("usage: not sampled (%s: %s); the stage goes on", type(exc).__name__, exc)
        sampler = None
    try:
        yield sampler
    finally:
        if sampler is not None:
            _finish(sampler, usage, local)


def _finish(sampler: Sampler, usage: str, local: bool) -> None:
    try:
        sampler.stop()
        if not local:
            atomic_write_text(usage, "".join(json.dumps(r) + "\n" for r in sampler.rows))
    except Exception as exc:
        log.warning("usage: last sample lost (%s: %s)", type(exc).__name__, exc)
