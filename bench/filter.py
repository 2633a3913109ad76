"""Benchmark: the filter stage over a generated rollouts file on a 2-worker LocalCluster.

    .venv/bin/python bench/filter.py [--size-gb 5] [--workers 2] [--rules full|light]
        [--dir DIR] [--keep]

Generates a rollouts JSONL of about `--size-gb` GB (rows of 0.5-2 KB, groups of
4 samples per prompt, uniform groups and duplicate answers among them) in a
temporary folder under `--dir` (default $TMPDIR, else bench/out), then runs
the filter stage as one Dask task on a LocalCluster of `--workers` processes,
as `pipe run` does: the stage splits the file into prompt-aligned partitions
and filters them on the workers. Reports rows/s of the filter (generation not
counted) and the peak RSS of the driver (this process) and of the workers,
sampled every 0.2 s. The files are deleted afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# fmt: off
WORDS = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be",
    "by", "this", "are", "from", "or", "at", "an", "not", "but", "which", "answer", "sum",
    "step", "first", "then", "total", "add", "carry", "digit", "result", "number", "so", "we",
    "get", "therefore", "check", "let", "compute", "value", "equals", "plus", "minus", "times",
    "write", "final", "box", "think",
]
# fmt: on
RULES = {
    "full": {
        "drop_uniform_groups": True,
        "max_length": 512,
        "length_unit": "tokens",
        "dedup": "normalized",
        "top_k_per_prompt": 2,
    },
    "light": {"drop_uniform_groups": True, "min_reward": 1.0},
}


def completions(rng: random.Random, n: int) -> list[str]:
    """A pool of answers of 250-1,700 characters."""
    pool = []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(45, 300))
        pool.append(" ".join(words) + f" <answer>{rng.randint(0, 999)}</answer>")
    return pool


def generate(path: Path, size_bytes: int, seed: int = 0) -> int:
    """Write rollouts until the file holds `size_bytes`; return the row count."""
    rng = random.Random(seed)
    pool = completions(rng, 4096)
    rows = 0
    written = 0
    with open(path, "w", buffering=1 << 22) as f:
        p = 0
        while written < size_bytes:
            prompt = f"Problem {p}: " + " ".join(rng.choices(WORDS, k=rng.randint(10, 60)))
            chance = rng.choice([0.0, 0.0, 1.0, 0.3, 0.5, 0.7])
            previous = ""
            for s in range(4):
                text = pool[rng.randrange(len(pool))]
                if previous and rng.random() < 0.05:
                    text = previous.upper()  # a duplicate after normalisation
                previous = text
                row = {
                    "prompt": prompt,
                    "answer": str(p % 1000),
                    "task": "chain_sum",
                    "prompt_idx": p,
                    "sample_idx": s,
                    "completion": text,
                    "reward": 1.0 if rng.random() < chance else 0.0,
                    "finish_reason": "stop",
                    "usage": {
                        "prompt_tokens": len(prompt) // 4,
                        "completion_tokens": len(text) // 4,
                    },
                    "latency_s": round(rng.uniform(0.05, 2.0), 3),
                }
                line = json.dumps(row) + "\n"
                f.write(line)
                written += len(line)
                rows += 1
            p += 1
    return rows


class PeakRSS:
    """Samples the RSS of this process and of its children (the workers) in a thread."""

    def __init__(self, interval: float = 0.2) -> None:
        import psutil

        self.me = psutil.Process()
        self.interval = interval
        self.driver = 0
        self.workers: dict[int, int] = {}
        self.total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        import psutil

        driver = self.me.memory_info().rss
        total = driver
        for child in self.me.children(recursive=True):
            try:
                rss = child.memory_info().rss
            except psutil.Error:
                continue
            self.workers[child.pid] = max(self.workers.get(child.pid, 0), rss)
            total += rss
        self.driver = max(self.driver, driver)
        self.total = max(self.total, total)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> PeakRSS:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def run_filter_on_cluster(
    src: Path, work: Path, workers: int, rules: str
) -> tuple[dict[str, Any], float, PeakRSS]:
    from distributed import Client, LocalCluster

    from engine.stage import StageContext
    from stages.filter import FilterConfig, filter_rollouts

    stage_dir = work / "filter"
    stage_dir.mkdir()
    cfg = FilterConfig(input=str(src), output=str(stage_dir / "filtered.jsonl"), **RULES[rules])
    ctx = StageContext("filter", "filter", str(stage_dir), str(work), str(work), workers=workers)
    with (
        LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=":0",
        ) as cluster,
        Client(cluster) as client,
        PeakRSS() as peak,
    ):
        start = time.perf_counter()
        report = client.submit(filter_rollouts, cfg, ctx, pure=False).result()
        seconds = time.perf_counter() - start
    return report, seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rules", choices=sorted(RULES), default="full")
    parser.add_argument("--dir", default=os.environ.get("TMPDIR") or None)
    parser.add_argument("--keep", action="store_true", help="Keep the generated files.")
    args = parser.parse_args()
    base = Path(args.dir) if args.dir else Path(__file__).resolve().parent / "out"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="filter-bench-", dir=base))
    try:
        src = work / "rollouts.jsonl"
        t0 = time.perf_counter()
        rows = generate(src, int(args.size_gb * 1e9))
        size = src.stat().st_size
        print(f"generated {rows:,} rows, {size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")
        report, seconds, peak = run_filter_on_cluster(src, work, args.workers, args.rules)
        ru_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        gib = 2**30
        print(f"rules: {args.rules} {json.dumps(RULES[args.rules])}")
        print(
            f"filter: {report['rows_in']:,} rows in {seconds:.1f} s = "
            f"{report['rows_in'] / seconds:,.0f} rows/s"
            f" ({size / 1e6 / seconds:.0f} MB/s), kept {report['rows_kept']:,},"
            f" {report['partitions']} partitions, mode {report['mode']}"
        )
        print(f"dropped: {json.dumps(report['dropped'])}")
        print(
            f"peak RSS: driver {peak.driver / gib:.2f} GiB (ru_maxrss {ru_maxrss / gib:.2f} GiB),"
            f" largest worker {max(peak.workers.values(), default=0) / gib:.2f} GiB,"
            f" driver + workers {peak.total / gib:.2f} GiB"
        )
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
