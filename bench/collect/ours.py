"""Our collector as the benchmark runs it: the collect stage function on one input.

    python bench/collect/ours.py IN.jsonl OUT.jsonl BASE_URL PARALLEL|auto [REPEATS]

Runs `stages.collect.run.run_collect` exactly as the engine would (openai
backend, exact_match verifier, resumable output), in a fresh stage folder
beside OUT. Modules are imported before the clock starts, as minimal.py
imports aiohttp at its top. Prints {"rollouts", "wall_s", "cpu_s", "limit"}
for the collection (from the call to the published, sorted output).
"""

import json
import logging
import os
import resource
import sys
import time

import aiohttp  # noqa: F401  (imported before the clock starts, as minimal.py does)

from engine.stage import StageContext
from stages.collect import CollectConfig
from stages.collect.run import run_collect


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    src, dst, base_url, parallel = sys.argv[1:5]
    repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    cfg = CollectConfig.model_validate(
        {
            "input": os.path.abspath(src),
            "output": os.path.abspath(dst),
            "num_samples_in_parallel": parallel if parallel == "auto" else int(parallel),
            "num_repeats": repeats,
            "backend": {"kind": "openai", "base_url": base_url, "model": "fake"},
            "verifier": {"kind": "exact_match"},
            "timeout_s": 60.0,
        },
        strict=False,
    )
    folder = os.path.dirname(os.path.abspath(dst))
    ctx = StageContext("collect", "collect", folder, folder, folder)
    t0, c0 = time.perf_counter(), cpu_s()
    metrics = run_collect(cfg, ctx)
    result = {
        "rollouts": metrics["rows"],
        "wall_s": time.perf_counter() - t0,
        "cpu_s": cpu_s() - c0,
        "limit": metrics["concurrency"],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
