"""Benchmark: validate a generated 1,000-stage pipeline (load + checks), best of 5.

.venv/bin/python bench/validate.py [--stages 1000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def generate(n: int) -> str:
    lines = ["# generated", "name: big", "stages:"]
    for i in range(n):
        kind = ("collect", "filter", "train", "evaluate")[i % 4]
        lines.append(f"  s{i}:")
        lines.append(f"    kind: {kind}")
        if i:
            lines.append(
                f"    needs: [s{i - 1}]" if i % 7 else f"    needs: [s{i - 1}, s{max(0, i - 5)}]"
            )
        if kind == "collect":
            source = ", input: prompts.jsonl" if i == 0 else ""
            lines.append(f"    config: {{num_repeats: 4, num_samples_in_parallel: 64{source}}}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, default=1000)
    args = parser.parse_args()
    text = generate(args.stages)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.yaml"
        path.write_text(text)
        t0 = time.perf_counter()
        from engine.load.load import load_pipeline

        load_pipeline(path)  # first run pays the imports
        first = time.perf_counter() - t0
        times = []
        for _ in range(5):
            t = time.perf_counter()
            load_pipeline(path)
            times.append(time.perf_counter() - t)
        import subprocess

        walls = []
        for _ in range(3):
            t = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "engine.cli", "validate", str(path)],
                check=True,
                capture_output=True,
            )
            walls.append(time.perf_counter() - t)
    print(f"stages: {args.stages}  file: {len(text) / 1024:.0f} KiB")
    print(f"validate, first (cold imports): {first:.3f} s")
    print(f"validate, best of 5 (warm):     {min(times):.3f} s")
    print(f"`pipe validate` process, best of 3 (start-up included): {min(walls):.3f} s")
    print(f"per stage (warm):               {min(times) / args.stages * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
