"""Benchmark: engine overhead per stage, 200 no-op stages on the embedded LocalCluster.

    .venv/bin/python bench/engine_overhead.py [--stages 200]

Runs a chain (each stage needs the previous: every stage is a scheduling round
trip) and a fan-out (all independent), each through `pipe run`'s code path
(load, resolve, plan, cache keys, submission, records), and prints the time per
stage with the cluster's start-up excluded, beside bare Dask tasks of the same shape
(`client.submit` of a no-op); the difference is the engine's own overhead.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "critical")


def pipeline(n: int, chain: bool) -> str:
    lines = ["name: bench", "cluster: {workers: 2}", "stages:"]
    for i in range(n):
        needs = f", needs: [s{i - 1}]" if chain and i else ""
        lines.append(f"  s{i}: {{kind: toy{needs}, config: {{value: v{i}}}}}")
    return "\n".join(lines) + "\n"


def noop(x: int) -> int:
    return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, default=200)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from engine.cluster.connect import connect
    from engine.load.load import load_pipeline
    from engine.plan.dag import plan
    from engine.resolve.resolve import resolve
    from engine.run.execute import execute
    from engine.run.report import RunReport, new_run_id
    from engine.run.select import RunOptions, prepare
    from tests.kinds import register

    register()
    cluster = connect("local", 2)
    try:
        client = cluster.client
        client.gather([client.submit(noop, i, pure=False) for i in range(10)])  # warm up
        t = time.perf_counter()
        client.gather([client.submit(noop, i, pure=False) for i in range(args.stages)])
        bare = {False: (time.perf_counter() - t) / args.stages}
        t = time.perf_counter()
        x = 0
        for _ in range(args.stages):
            x = client.submit(noop, x, pure=False).result()
        bare[True] = (time.perf_counter() - t) / args.stages
        print(f"stages: {args.stages}, workers: 2 (LocalCluster, processes)")
        print(f"bare Dask no-op task, fan-out: {bare[False] * 1e3:6.2f} ms per task")
        print(
            f"bare Dask no-op task, chain:   {bare[True] * 1e3:6.2f} ms per task (submit, wait "
            "for the result, repeat)"
        )
        for chain in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "bench.yaml"
                path.write_text(pipeline(args.stages, chain))
                t = time.perf_counter()
                planned = plan(resolve(load_pipeline(path), run_dir=f"{tmp}/runs"))
                report = RunReport(new_run_id(), str(path), "bench", "local")
                keys, pending = prepare(planned, RunOptions(), report)
                execute(planned, cluster, report, RunOptions(), keys, pending)
                report.write(f"{tmp}/runs")
                total = time.perf_counter() - t
                ok = sum(r.status == "succeeded" for r in report.stages.values())
                shape = "chain  " if chain else "fan-out"
                per = total / args.stages * 1e3
                over = per - bare[chain] * 1e3
                print(
                    f"pipe run, {shape}: {total:6.2f} s total, {per:6.2f} ms per stage ({ok} "
                    "succeeded); "
                    f"engine overhead over bare Dask: {over:6.2f} ms per stage"
                )
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
