"""What a stage uses: the sampler on the worker (a fake NVML at the edge), its rows, the
summary the stage's metrics carry, the headline line and the plot (the GPU verdict of `pipe
tune --diagnose`: tests/unit/test_tune.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from engine.run.headline import headlines
from engine.run.report import RunReport
from engine.run.usage import sampling
from engine.run.usage_summary import plot_usage, read_usage, summarize, usage_line


class FakeNvml:
    """Two GPUs at the edge: device 3 busy, device 5 idle; counts its reads."""

    def __init__(self) -> None:
        self.reads = 0
        self.closed = False

    def read(self) -> list[tuple[int, float, float]]:
        self.reads += 1
        return [(3, 90.0, 40.5), (5, 10.0, 1.5)]

    def close(self) -> None:
        self.closed = True


def _busy(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_the_sampler_writes_cpu_and_gpu_rows_and_events_for_the_trackers(tmp_path: Path):
    nvml = FakeNvml()
    with sampling(str(tmp_path), "tcp://w:1", (3, 5), reader=nvml, interval_s=0.05) as sampler:
        deadline = time.monotonic() + 20  # busy until the sampler took 3 samples (a loaded
        while sampler is not None and sampler.samples < 3 and time.monotonic() < deadline:
            _busy(0.05)  # machine may give its thread few chances)
    assert sampler is not None and nvml.closed
    rows = [json.loads(line) for line in (tmp_path / "usage.jsonl").read_text().splitlines()]
    cpu = [r for r in rows if "gpu" not in r]
    gpus = [r for r in rows if "gpu" in r]
    assert len(cpu) >= 3 and len(gpus) == 2 * len(cpu) == 2 * nvml.reads
    assert set(cpu[0]) == {"time", "worker", "cpu_util", "rss_gb"}
    assert set(gpus[0]) == {"time", "worker", "cpu_util", "rss_gb", "gpu", "gpu_util", "gpu_mem_gb"}
    assert {(r["gpu"], r["gpu_util"], r["gpu_mem_gb"]) for r in gpus} == {
        (3, 90.0, 40.5),
        (5, 10.0, 1.5),
    }
    assert cpu[0]["worker"] == "tcp://w:1" and 0.01 < cpu[0]["rss_gb"] < 64
    assert max(r["cpu_util"] for r in cpu[1:]) > 30  # the busy loop shows
    events = [json.loads(line) for line in (tmp_path / "track.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events] == list(range(len(cpu)))
    assert events[0]["metrics"]["usage/gpu3_util"] == 90.0
    assert events[0]["metrics"]["usage/gpu5_mem_gb"] == 1.5
    summary = summarize(read_usage(str(tmp_path)))
    assert summary["gpu_util_mean"] == 50.0 and summary["gpu_util_peak"] == 90.0
    assert summary["gpu_mem_gb_peak"] == 40.5 and summary["samples"] == len(cpu)


def test_without_gpus_the_rows_carry_cpu_and_memory_only(tmp_path: Path):
    with sampling(str(tmp_path), "local", interval_s=10):
        pass  # shorter than the interval: the last sample only
    rows = read_usage(str(tmp_path))
    assert len(rows) == 1 and all("gpu" not in r for r in rows)
    assert "gpu_util_mean" not in summarize(rows)


ROWS: list[dict[str, Any]] = [
    {"time": 1.0, "worker": "a", "cpu_util": 100.0, "rss_gb": 1.0},
    {"time": 1.0, "worker": "b", "cpu_util": 50.0, "rss_gb": 0.5},
    {"time": 1.0, "worker": "a", "cpu_util": 100.0, "rss_gb": 1.0, "gpu": 0, "gpu_util": 40.0, "gpu_mem_gb": 20.0},
    {"time": 3.0, "worker": "a", "cpu_util": 10.0, "rss_gb": 2.0},
    {"time": 3.0, "worker": "a", "cpu_util": 10.0, "rss_gb": 2.0, "gpu": 0, "gpu_util": 60.0, "gpu_mem_gb": 30.0},
]  # fmt: skip


def test_mean_and_peak_sum_the_workers_at_each_time():
    assert summarize(ROWS) == {
        "samples": 2.0,
        "cpu_util_mean": 80.0,
        "cpu_util_peak": 150.0,
        "rss_gb_mean": 1.75,
        "rss_gb_peak": 2.0,
        "gpu_util_mean": 50.0,
        "gpu_util_peak": 60.0,
        "gpu_mem_gb_mean": 25.0,
        "gpu_mem_gb_peak": 30.0,
    }
    assert summarize([]) == {}


def test_the_headline_starts_with_what_each_stage_used(tmp_path: Path):
    report = RunReport("run-1", "p.yaml", "p", "local")
    rec = report.add("filter", "filter", "k", str(tmp_path / "filter"))
    rec.status = "succeeded"
    rec.metrics = {"rows_in": 10, "rows_kept": 7, "dropped": {}, "usage": summarize(ROWS)}
    assert headlines(report) == [
        "filter used: cpu 80% mean, 150% peak; rss 2.00 GB peak; gpu 50% mean, 60% peak, "
        "30.0 GB peak",
        "filter: kept 7 of 10 rows; dropped: none",
    ]
    assert usage_line(summarize(ROWS[:2])) == "cpu 150% mean, 150% peak; rss 1.50 GB peak"


def test_the_plot_is_written_once_the_stage_ran_a_minute_of_samples(tmp_path: Path):
    from engine.run.usage_summary import PLOT_SAMPLES

    many = [{**r, "time": r["time"] + 4 * t} for t in range(PLOT_SAMPLES) for r in ROWS]
    assert not plot_usage(ROWS, str(tmp_path / "short.png"), "short")
    assert plot_usage(many, str(tmp_path / "usage.png"), "s: usage")
    assert (tmp_path / "usage.png").read_bytes()[:4] == b"\x89PNG"


def test_a_stage_run_on_a_worker_writes_its_usage_and_carries_the_summary(tmp_path: Path):
    from engine.run.task import run_stage
    from engine.stage import StageConfig
    from tests.conftest import toy_payload

    def body(cfg: StageConfig, ctx) -> dict[str, int]:  # type: ignore[no-untyped-def]
        return {"rows": 1}

    payload = toy_payload(tmp_path, body, __name__)
    metrics = run_stage(payload).metrics
    # one row at the end, and one per interval (2 s) the stage outlived: a loaded machine
    # may take that long to set the stage up
    rows = read_usage(str(tmp_path / "s"))
    assert metrics["rows"] == 1 and metrics["usage"]["samples"] == len(rows) >= 1
    assert json.loads((tmp_path / "s" / "metrics.json").read_text())["usage"] == metrics["usage"]


def test_the_processes_a_stage_starts_are_counted(tmp_path: Path):
    import subprocess
    import sys

    code = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass"
    with sampling(str(tmp_path), "w", interval_s=60) as sampler:
        child = subprocess.Popen([sys.executable, "-c", code + "\ntime.sleep(5)"])
        time.sleep(0.8)  # the child's busy 0.4 s, then asleep: seen for the first time now
        rows = sampler.sample() if sampler is not None else []
        child.kill()
        child.wait()
    assert rows[0]["cpu_util"] > 20 and rows[0]["rss_gb"] > 0.01
