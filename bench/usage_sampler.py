"""Benchmark: what the usage sampler (engine/run/usage.py) costs a stage's worker.

    .venv/bin/python bench/usage_sampler.py [--children 4] [--samples 200] [--gpus 0]

Times one sample (the process tree's CPU % and RSS, a row to usage.jsonl, an event to
track.jsonl) in CPU seconds, with `--children` processes under this one (a stage's ranks
or servers), and `--gpus` GPUs read through a fake NVML reader (the reader's own cost on a
GPU machine is NVML's: two calls per GPU), then gives the share of one core the sampler
takes at its default interval (2 s): CPU per sample / interval. Also the wall cost the
sampler adds to a stage that does nothing (start, first and last sample, the summary).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.run.usage import INTERVAL_S, Sampler, sampling
from engine.run.usage_summary import read_usage, summarize


class FakeGpus:
    def __init__(self, n: int) -> None:
        self.n = n

    def read(self) -> list[tuple[int, float, float]]:
        return [(i, 50.0, 10.0) for i in range(self.n)]

    def close(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--children", type=int, default=4)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--gpus", type=int, default=0)
    args = ap.parse_args()
    kids = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        for _ in range(args.children)
    ]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            gpus = FakeGpus(args.gpus) if args.gpus else None
            sampler = Sampler(
                "bench",
                gpus,
                usage_path=os.path.join(tmp, "usage.jsonl"),
                events_path=os.path.join(tmp, "track.jsonl"),
            )
            sampler.sample()
            cpu0 = time.process_time()
            for _ in range(args.samples):
                sampler.sample()
            per = (time.process_time() - cpu0) / args.samples
            print(f"processes sampled: {1 + args.children}, GPUs: {args.gpus}")
            print(f"CPU per sample: {per * 1000:.2f} ms")
            print(f"share of one core at {INTERVAL_S:.0f} s: {per / INTERVAL_S:.3%}")
            walls = []
            for i in range(20):
                stage = os.path.join(tmp, f"s{i}")
                os.makedirs(stage)
                t0 = time.perf_counter()
                with sampling(stage, "bench", reader=gpus):
                    pass
                summarize(read_usage(stage))
                walls.append(time.perf_counter() - t0)
            walls.sort()
            print(f"added to an empty stage (median of 20): {walls[10] * 1000:.2f} ms wall")
    finally:
        for k in kids:
            k.kill()


if __name__ == "__main__":
    main()
