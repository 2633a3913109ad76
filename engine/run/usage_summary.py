"""A stage's usage rows -> its mean and peak, one line for the run's headline, a plot, and the
guide's verdict on GPU utilisation.

Input: the rows `engine.run.usage` samples (from memory or the stage's `usage*.jsonl`).
Output: `summarize` (the `"usage"` figures a stage's metrics, `report.json` and the trackers'
summary carry), `usage_line` (what `pipe run` prints under the stages' headlines),
and `plot_usage` (`usage.png` in the stage's folder, the guide's 80% GPU target drawn).
`pipe tune --diagnose` reads the summary from the stage's `metrics.json`
(`stages.collect.tune.sweep.gpu_advice`).
"""

from __future__ import annotations

import glob
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

log = logging.getLogger("pipe.usage")
PLOT_SAMPLES = 30  # a minute at the 2 s interval: a shorter stage has little to plot
GPU_TARGET = 80.0  # the OpenRLHF tuning guide: "GPU utilization: should be >80%"


def _mean_peak(values: Sequence[float]) -> tuple[float, float]:
    return round(sum(values) / len(values), 2), round(max(values), 2)


def summarize(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Mean and peak of CPU % and RSS over the CPU rows (per worker: summed at each time), and
    of utilisation and memory over the GPU rows (every GPU's sample one value); {} without
    rows."""
    cpu: dict[float, list[float]] = {}
    rss: dict[float, list[float]] = {}
    util: list[float] = []
    mem: list[float] = []
    for row in rows:
        if "gpu" in row:
            util.append(float(row["gpu_util"]))
            mem.append(float(row["gpu_mem_gb"]))
            continue
        cpu.setdefault(float(row["time"]), []).append(float(row["cpu_util"]))
        rss.setdefault(float(row["time"]), []).append(float(row["rss_gb"]))
    if not cpu:
        return {}
    out: dict[str, float] = {"samples": float(len(cpu))}
    series = {
        "cpu_util": [sum(v) for v in cpu.values()],
        "rss_gb": [sum(v) for v in rss.values()],
        "gpu_util": util,
        "gpu_mem_gb": mem,
    }
    for name, values in series.items():
        if values:
            out[f"{name}_mean"], out[f"{name}_peak"] = _mean_peak(values)
    return out


def read_usage(stage_dir: str) -> list[dict[str, Any]]:
    """Every row of a stage's `usage*.jsonl` files (each task's), unreadable lines skipped."""
    rows: list[dict[str, Any]] = []
    for path in sorted(glob.glob(f"{glob.escape(stage_dir.rstrip('/'))}/usage*.jsonl")):
        try:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        continue
        except OSError:
            continue
    return rows


def usage_line(summary: Mapping[str, Any]) -> str:
    """`cpu 87% mean, 190% peak; rss 1.2 GB peak; gpu 73% mean, 99% peak, 40.1 GB peak`."""
    parts = [
        f"cpu {summary['cpu_util_mean']:.0f}% mean, {summary['cpu_util_peak']:.0f}% peak",
        f"rss {summary['rss_gb_peak']:.2f} GB peak",
    ]
    if "gpu_util_mean" in summary:
        parts.append(
            f"gpu {summary['gpu_util_mean']:.0f}% mean, {summary['gpu_util_peak']:.0f}% peak, "
            f"{summary['gpu_mem_gb_peak']:.1f} GB peak"
        )
    return "; ".join(parts)


def plot_usage(rows: Sequence[Mapping[str, Any]], path: str, title: str) -> bool:
    """CPU % and RSS over time (and each GPU's utilisation and memory) to a PNG; False without
    matplotlib or with fewer than `PLOT_SAMPLES` samples (a stage of a few seconds: the plot
    would cost more than the stage)."""
    cpu = [r for r in rows if "gpu" not in r]
    if len(cpu) < PLOT_SAMPLES:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    t0 = min(float(r["time"]) for r in rows)
    gpus = sorted({(r["worker"], r["gpu"]) for r in rows if "gpu" in r})
    fig, axes = plt.subplots(2 if gpus else 1, 2, figsize=(10, 6 if gpus else 3.5), squeeze=False)
    try:
        for worker in sorted({r["worker"] for r in cpu}):
            mine = [r for r in cpu if r["worker"] == worker]
            xs = [float(r["time"]) - t0 for r in mine]
            axes[0][0].plot(xs, [r["cpu_util"] for r in mine], label=worker)
            axes[0][1].plot(xs, [r["rss_gb"] for r in mine], label=worker)
        axes[0][0].set_ylabel("CPU % of one core")
        axes[0][1].set_ylabel("RSS (GB)")
        for worker, gpu in gpus:
            mine = [r for r in rows if r.get("gpu") == gpu and r["worker"] == worker]
            xs = [float(r["time"]) - t0 for r in mine]
            axes[1][0].plot(xs, [r["gpu_util"] for r in mine], label=f"GPU {gpu}")
            axes[1][1].plot(xs, [r["gpu_mem_gb"] for r in mine], label=f"GPU {gpu}")
        if gpus:
            axes[1][0].axhline(GPU_TARGET, color="grey", linestyle=":", label="80% target")
            axes[1][0].set_ylabel("GPU utilisation %")
            axes[1][1].set_ylabel("GPU memory (GB)")
        for ax in axes.flat:
            ax.set_xlabel("seconds")
            ax.legend(fontsize="small")
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return True
