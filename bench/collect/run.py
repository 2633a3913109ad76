"""Collector benchmark: ours against a minimal asyncio + aiohttp + Semaphore script, side by side.

    .venv/bin/python bench/collect/run.py            # everything, a few minutes on 2 cores
    .venv/bin/python bench/collect/run.py --quick    # smaller sweep, no 100k-prompt RSS run

The fake OpenAI server (bench/collect/fake_server.py) and each collector run
in separate processes, so each one's CPU is its own (child rusage from
os.wait4; the collectors also report the CPU of their collection window).

1. Sweep: rollouts/s and CPU ms per rollout (collection window) at
   parallelism 8/32/128/512, server latency 0 and 200 ms (capacity 1024, so
   the collector, not the server's slots, is what is measured).
2. Acceptance 1: capacity 128, latency 200 ms (limit 640 rollouts/s), 1,000
   prompts x 4 repeats = 4,000 rollouts at parallelism 256 and with `auto`;
   3 rounds (`--rounds`), each run on a fresh server, medians reported.
3. Acceptance 2: marginal CPU per rollout at latency 0 from two input sizes
   (so start-up cancels; 3 runs of each, the two collectors alternating;
   best and median; whole-process CPU as asked, and the collection window's,
   which leaves out the noise of interpreter start and imports), ours /
   minimal; and the peak RSS of our collector on 100,000 prompts.
4. `--only instructions` (not in the default run, ~4 minutes): the same
   marginal cost counted in user-space instructions under callgrind, which
   the load of a shared machine does not disturb.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fake_server import expected_answer, start_subprocess  # noqa: E402

SCRIPTS = {"minimal": HERE / "minimal.py", "ours": HERE / "ours.py"}


def write_prompts(path: Path, n: int) -> Path:
    with open(path, "w") as out:
        for i in range(n):
            prompt = f"What is {i} + {i % 97}? Answer inside <answer></answer>."
            out.write(json.dumps({"prompt": prompt, "answer": expected_answer(prompt)}) + "\n")
    return path


def run_child(tool: str, src: Path, base_url: str, parallel: str, repeats: int = 1) -> dict:
    """Run one collector process; its own report plus whole-process CPU and peak RSS."""
    out = src.with_name(f"{src.stem}-{tool}-{parallel}-{os.urandom(3).hex()}.jsonl")
    cmd = [sys.executable, str(SCRIPTS[tool]), str(src), str(out), base_url, parallel, str(repeats)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent.parent))
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env)
        assert proc.stdout is not None
        text = proc.stdout.read().decode()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{tool} failed: {err.read().decode()[-2000:]}")
    result = json.loads(text.strip().splitlines()[-1])
    result["total_cpu_s"] = usage.ru_utime + usage.ru_stime
    result["maxrss_mb"] = usage.ru_maxrss / 1024
    with open(out, "rb") as handle:
        lines = sum(1 for _ in handle)
    if lines != result["rollouts"]:
        raise RuntimeError(f"{tool}: {lines} lines written, {result['rollouts']} reported")
    out.unlink()
    return result


def sweep(work: Path, quick: bool) -> None:
    print("\n## Sweep: rollouts/s and CPU ms per rollout (collection window), capacity 1024")
    print(
        f"{'latency':>8} {'par':>5} {'n':>6} | {'minimal r/s':>11} {'cpu ms':>7} | "
        f"{'ours r/s':>9} {'cpu ms':>7} | {'r/s ratio':>9} {'cpu ratio':>9}"
    )
    for latency in (0, 200):
        server = start_subprocess(1024, latency)
        try:
            for par in (8, 32, 128, 512):
                n = 1500 if latency == 0 else max(100, int(par / 0.2 * 2.5))
                if quick:
                    n = max(100, n // 3)
                src = write_prompts(work / f"sweep-{latency}-{par}.jsonl", n)
                base = run_child("minimal", src, server.url, str(par))
                ours = run_child("ours", src, server.url, str(par))
                rb, ro = base["rollouts"] / base["wall_s"], ours["rollouts"] / ours["wall_s"]
                cb, co = 1000 * base["cpu_s"] / n, 1000 * ours["cpu_s"] / n
                print(
                    f"{latency:>6}ms {par:>5} {n:>6} | {rb:>11.0f} {cb:>7.3f} | "
                    f"{ro:>9.0f} {co:>7.3f} | {ro / rb:>9.2f} {co / cb:>9.2f}",
                    flush=True,
                )
        finally:
            server.stop()


def acceptance_throughput(work: Path, repeats: int, prompts: int) -> None:
    print(
        f"\n## Acceptance 1: capacity 128, latency 200 ms (limit 640/s), {prompts} prompts x 4 "
        f"repeats, {repeats} round(s), a fresh server per run"
    )
    src = write_prompts(work / "accept1.jsonl", prompts)
    rates: dict[str, list[float]] = {}
    for _ in range(repeats):
        for tool, par in (("minimal", "256"), ("ours", "256"), ("ours", "auto")):
            server = start_subprocess(128, 200)
            try:
                res = run_child(tool, src, server.url, par, repeats=4)
            finally:
                server.stop()
            rate = res["rollouts"] / res["wall_s"]
            rates.setdefault(f"{tool} {par}", []).append(rate)
            extra = f"  concurrency {res['limit']}" if "limit" in res else ""
            print(
                f"{tool:>8} parallelism {par:>4}: {res['rollouts']} rollouts in "
                f"{res['wall_s']:.2f} s = {rate:.0f} rollouts/s = {100 * rate / 640:.1f}% of 640"
                f"{extra}",
                flush=True,
            )
    if repeats > 1:
        for name, values in rates.items():
            median = statistics.median(values)
            print(
                f"  median {name:>12}: {median:.0f} rollouts/s = {100 * median / 640:.1f}% of 640"
            )


def acceptance_cpu(work: Path, quick: bool) -> None:
    small, large = (1000, 4000) if quick else (2000, 20000)
    reps = 2 if quick else 3
    print(
        f"\n## Acceptance 2: marginal CPU per rollout at latency 0 ({small} vs {large} prompts, "
        f"parallelism 64, {reps} runs each, order alternating)"
    )
    inputs = {n: write_prompts(work / f"cpu-{n}.jsonl", n) for n in (small, large)}
    server = start_subprocess(1024, 0)
    runs: dict[tuple[str, str, int], list[float]] = {}
    try:
        for rep in range(reps):
            for n, src in inputs.items():
                for tool in ("minimal", "ours") if rep % 2 == 0 else ("ours", "minimal"):
                    res = run_child(tool, src, server.url, "64")
                    runs.setdefault(("process", tool, n), []).append(res["total_cpu_s"])
                    runs.setdefault(("window", tool, n), []).append(res["cpu_s"])
    finally:
        server.stop()
    for scope, what in (("process", "whole-process CPU"), ("window", "collection-window CPU")):
        for name, pick in (("best", min), ("median", statistics.median)):
            marginal = {
                t: 1000
                * (pick(runs[scope, t, large]) - pick(runs[scope, t, small]))
                / (large - small)
                for t in SCRIPTS
            }
            print(
                f"  {what:>21}, {name:>6} of runs: minimal {marginal['minimal']:.3f} ms, ours "
                f"{marginal['ours']:.3f} ms per rollout -> ours / minimal "
                f"{marginal['ours'] / marginal['minimal']:.2f} (bar: <= 1.2)"
            )
    for (scope, tool, n), cpus in sorted(runs.items()):
        if scope == "process":
            print(
                f"  {tool:>8} {n:>6} prompts: process CPU s {', '.join(f'{c:.2f}' for c in cpus)}"
            )


def instructions(work: Path) -> None:
    """Marginal user-space instructions per rollout (callgrind): deterministic, load-proof."""
    small, large = 500, 2500
    print(
        f"\n## Acceptance 2 (instructions): callgrind, latency 0, parallelism 64, {small} vs "
        f"{large} prompts"
    )
    if shutil.which("valgrind") is None:
        print("  valgrind not found: skipped")
        return
    server = start_subprocess(1024, 0)
    counts: dict[tuple[str, int], int] = {}
    try:
        for n in (small, large):
            src = write_prompts(work / f"vg-{n}.jsonl", n)
            for tool in SCRIPTS:
                out = src.with_name(f"vg-{tool}-{n}.jsonl")
                cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
                cmd += [sys.executable, str(SCRIPTS[tool]), str(src), str(out), server.url, "64"]
                env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent.parent))
                done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
                found = re.search(r"Collected : (\d+)", done.stderr)
                assert found, done.stderr[-2000:]
                counts[tool, n] = int(found.group(1))
    finally:
        server.stop()
    per = {t: (counts[t, large] - counts[t, small]) / (large - small) for t in SCRIPTS}
    print(
        f"  minimal {per['minimal'] / 1000:.0f}k, ours {per['ours'] / 1000:.0f}k instructions per "
        f"rollout -> ours / minimal {per['ours'] / per['minimal']:.2f} (bar: <= 1.2)"
    )


def acceptance_rss(work: Path) -> None:
    print(
        "\n## Acceptance 2b: peak RSS of our collector, 100,000 prompts, latency 0, parallelism 128"
    )
    src = write_prompts(work / "rss-100k.jsonl", 100_000)
    server = start_subprocess(1024, 0)
    try:
        res = run_child("ours", src, server.url, "128")
    finally:
        server.stop()
    print(
        f"    ours: {res['rollouts']} rollouts in {res['wall_s']:.1f} s, peak RSS "
        f"{res['maxrss_mb']:.0f} MB (bar: < 150 MB)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="collector benchmark")
    parser.add_argument("--quick", action="store_true", help="smaller sweep, no RSS run")
    parser.add_argument(
        "--only",
        choices=["sweep", "throughput", "cpu", "instructions", "rss"],
        action="append",
        help="run only these parts (instructions: callgrind, ~4 min, not in the default run)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of the acceptance-1 runs (median reported)"
    )
    parser.add_argument(
        "--prompts", type=int, default=1000, help="acceptance-1 prompts (x 4 repeats)"
    )
    args = parser.parse_args()
    parts = args.only or ["sweep", "throughput", "cpu"] + ([] if args.quick else ["rss"])
    with tempfile.TemporaryDirectory(prefix="bench-collect-") as tmp:
        work = Path(tmp)
        if "sweep" in parts:
            sweep(work, args.quick)
        if "throughput" in parts:
            acceptance_throughput(work, 1 if args.quick else args.rounds, args.prompts)
        if "cpu" in parts:
            acceptance_cpu(work, args.quick)
        if "instructions" in parts:
            instructions(work)
        if "rss" in parts:
            acceptance_rss(work)


if __name__ == "__main__":
    main()
