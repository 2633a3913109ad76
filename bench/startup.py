"""Benchmark: the fixed start-up cost of `pipe run`, beside a bare import of what the stage needs.

    .venv/bin/python bench/startup.py [--runs 5] [--tree DIR]

Runs `pipe run --force` of two one-stage pipelines, `--runs` times each (after one
unmeasured warm-up), interleaved with a bare `python -c "import <the stage's imports>"`:

- dataset: one dataset stage of 20 reasoning-gym rows (`chain_sum`); bare: `import reasoning_gym`;
- collect: one collect stage of one prompt against bench/collect/fake_server.py, started here
  on 127.0.0.1 (its own process, not counted); bare: `import aiohttp`.

`--tree` runs another checkout's code (its folder goes first on PYTHONPATH; this script and
the fake server stay the same), so a tree before a change can be measured the same way.

Each run is timed from outside: the driver is the console script's two lines (`from
engine.cli import main; main()`) in a file, which also prints when its imports are done
(`engine.cli` and `engine.run.driver`, what `pipe run` imports before it starts). The breakdown:
`imports` (interpreter start and those imports), `cluster` (load, resolve, plan, and
the cluster until the driver logs `cluster: ... ready`, timed as the line arrives),
`task` (until the stage's task runs: `start` of its record in report.json), `body` (the
stage's `start` to `end` there) and `exit` (until the process has exited); CPU is the
driver's and every process it started, the workers and what outlives the driver (the fork
server, multiprocessing's resource tracker: this bench is their subreaper and waits for
them, Linux only; wall ends when the driver exits). Medians of the runs; `over bare` is
the run's wall (or CPU) minus the bare import's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.collect.fake_server import start_subprocess  # noqa: E402

LAUNCHER = """\
import sys, time
from engine.cli import main
if __name__ == "__main__":  # spawned workers import this file as __mp_main__, as they do `pipe`
    import engine.run.driver
    print("pipe-bench imported", time.time(), file=sys.stderr, flush=True)
    sys.argv[0] = "pipe"
    sys.exit(main())
"""

DATASET = """\
name: startup_dataset
stages:
  data:
    kind: dataset
    config: {task: chain_sum, size: 20}
"""

COLLECT = """\
name: startup_collect
stages:
  collect:
    kind: collect
    config:
      input: prompts.jsonl
      backend: {kind: openai, base_url: "URL", model: fake}
      verifier: {kind: exact_match}
"""

KEEP: set[int] = set()  # children of this bench that outlive a run (the fake server)
READY = re.compile(r"^cluster: .* ready in ")
PHASES = ("imports", "cluster", "task", "body", "exit")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def adopt_orphans() -> None:
    """Become the subreaper of every process started from here (Linux): a process the driver
    leaves behind (the fork server its workers fork from, multiprocessing's resource tracker)
    becomes this one's child when the driver exits, so its CPU is waited for and counted."""
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit("prctl(PR_SET_CHILD_SUBREAPER) failed: the CPU of orphaned processes is not seen")


def reap_orphans(keep: set[int], timeout_s: float = 30.0) -> None:
    """Wait for this process's children other than `keep` to exit (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kids = set()
        for task in Path(f"/proc/{os.getpid()}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread that just ended
                kids.update(int(p) for p in (task / "children").read_text().split())
        left = kids - keep
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.01)
    sys.exit(f"processes left behind by the driver did not exit in {timeout_s} s")


@dataclass
class Sample:
    wall: float
    cpu: float
    phases: dict[str, float] = field(default_factory=dict)


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[Sample, dict[str, float]]:
    """Run `cmd`; its wall and CPU, and when (epoch seconds) each marker line reached stderr."""
    marks: dict[str, float] = {}
    lines: list[str] = []
    c0, t0 = children_cpu(), time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            now = time.time()
            lines.append(line)
            if line.startswith("pipe-bench imported ") and "imports" not in marks:
                marks["imports"] = float(line.split()[-1])
            elif READY.match(line) and "cluster" not in marks:
                marks["cluster"] = now

    reader = threading.Thread(target=read)
    reader.start()
    rc = proc.wait()
    t1 = time.time()
    reader.join()
    reap_orphans(KEEP)
    if rc != 0:
        sys.exit(f"{' '.join(cmd)} failed ({rc}):\n{''.join(lines)}")
    marks["t0"], marks["exit"] = t0, t1
    return Sample(t1 - t0, children_cpu() - c0), marks


def run_pipe(python: str, folder: Path, env: dict[str, str]) -> Sample:
    cmd = [python, str(folder / "pipe_launch.py"), "run", "p.yaml", "--force", "--run-dir", "runs"]
    sample, marks = timed(cmd, folder, env)
    report = json.loads((folder / "runs" / "report.json").read_text())
    (stage,) = report["stages"].values()
    start, end = stage["start"], stage["end"]
    cluster = marks.get("cluster", start)
    sample.phases = {
        "imports": marks["imports"] - marks["t0"],
        "cluster": cluster - marks["imports"],
        "task": start - cluster,
        "body": end - start,
        "exit": marks["exit"] - end,
    }
    return sample


def bare(python: str, module: str, folder: Path, env: dict[str, str]) -> Sample:
    return timed([python, "-c", f"import {module}"], folder, env)[0]


def median(samples: list[Sample], get: str) -> float:
    if get in ("wall", "cpu"):
        return statistics.median(getattr(s, get) for s in samples)
    return statistics.median(s.phases[get] for s in samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tree", default=str(ROOT), help="the checkout whose code runs")
    args = parser.parse_args()
    tree = Path(args.tree).resolve()
    python = sys.executable
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    adopt_orphans()
    server = start_subprocess(64, 0.0)
    KEEP.add(server.proc.pid)
    try:
        with tempfile.TemporaryDirectory(prefix="pipe-startup-") as tmp:
            cases = {"dataset": "reasoning_gym", "collect": "aiohttp"}
            folders = {}
            for case, text in (("dataset", DATASET), ("collect", COLLECT)):
                folder = Path(tmp) / case
                folder.mkdir()
                (folder / "p.yaml").write_text(text.replace("URL", server.url))
                (folder / "pipe_launch.py").write_text(LAUNCHER)
                (folder / "prompts.jsonl").write_text('{"prompt": "What is 2 + 2?"}\n')
                folders[case] = folder
            runs: dict[str, list[Sample]] = {c: [] for c in cases}
            bares: dict[str, list[Sample]] = {c: [] for c in cases}
            for i in range(args.runs + 1):  # the first round warms the file cache, unmeasured
                for case, module in cases.items():
                    b = bare(python, module, folders[case], env)
                    r = run_pipe(python, folders[case], env)
                    if i:
                        bares[case].append(b)
                        runs[case].append(r)
    finally:
        server.stop()
    print(f"tree: {tree} (git {_commit(tree)}), {os.cpu_count()} cores, medians of {args.runs}")
    head = f"{'case':8s} {'':9s} {'wall s':>7s} {'CPU s':>7s} " + " ".join(
        f"{p:>7s}" for p in PHASES
    )
    print(head)
    for case, module in cases.items():
        r, b = runs[case], bares[case]
        phases = " ".join(f"{median(r, p):7.2f}" for p in PHASES)
        print(
            f"{case:8s} {'pipe run':9s} {median(r, 'wall'):7.2f} {median(r, 'cpu'):7.2f} {phases}"
        )
        print(
            f"{'':8s} {'bare':9s} {median(b, 'wall'):7.2f} {median(b, 'cpu'):7.2f}   (import "
            f"{module})"
        )
        over_wall = statistics.median(x.wall - y.wall for x, y in zip(r, b, strict=True))
        over_cpu = statistics.median(x.cpu - y.cpu for x, y in zip(r, b, strict=True))
        ratio = median(r, "wall") / median(b, "wall")
        print(
            f"{'':8s} {'over bare':9s} {over_wall:7.2f} {over_cpu:7.2f}   "
            f"(wall {ratio:.2f}x bare; target: <= 1.00 s over bare)"
        )


def _commit(tree: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


if __name__ == "__main__":
    main()
