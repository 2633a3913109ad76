"""Benchmark: on-policy distillation beside GRPO from the same student (issue 59, point 2).

    .venv/bin/python bench/distill.py [--run-dir runs/distill_quickstart] [--report]

Runs pipelines/distill_quickstart.yaml through `pipe run` (a rerun reuses what is cached;
`--report` runs nothing and reads the run folder as it is) and prints: the four
checkpoints' held-out accuracy (evaluate's, greedy, the 500 test prompts), each rl stage's
held-out accuracy at every `eval_every` step, and the issue's goal: the first step at which
the distilled student is within 5 points of the teacher, and the first at which GRPO reaches
that accuracy (or that it does not within its steps). Writes bench/out/distill/results.json
and distill.png (held-out accuracy against step for both stages, the teacher a line).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "distill"
PIPELINE = "pipelines/distill_quickstart.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
WITHIN = 0.05  # the goal: the distilled student within 5 points of the teacher
RATIO = 5  # ... in at most a fifth of GRPO's steps to the same accuracy


def curve(stage: Path) -> dict[int, float]:
    """An rl stage's held-out accuracy by step, step 0 the student's."""
    result = json.loads((stage / "rl_result.json").read_text())
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    got = {0: result["eval_accuracy_start"]}
    got.update({r["step"]: r["eval_accuracy"] for r in rows if r.get("eval_accuracy") is not None})
    return dict(sorted(got.items()))


def first(points: dict[int, float], at_least: float) -> int | None:
    return next((s for s, a in points.items() if a >= at_least), None)


def figures(run_dir: Path) -> dict[str, Any]:
    report = json.loads((run_dir / "evaluate" / "report.json").read_text())
    accuracy = {Path(r["checkpoint"]).name: r["accuracy"] for r in report["results"]}
    curves = {name: curve(run_dir / name) for name in ("distill", "grpo")}
    seconds = {
        name: json.loads((run_dir / name / "rl_result.json").read_text()).get("seconds")
        for name in curves
    }
    target = accuracy["teacher"] - WITHIN
    distill_at = first(curves["distill"], target)
    reached = curves["distill"][distill_at] if distill_at is not None else None
    grpo_at = first(curves["grpo"], reached) if reached is not None else None
    return {
        "accuracy": accuracy,
        "curves": curves,
        "rl_seconds": seconds,
        "target": target,
        "distill_step": distill_at,
        "distill_accuracy": reached,
        "grpo_step": grpo_at,
        "grpo_steps_run": max(curves["grpo"]),
    }


def verdict(got: dict[str, Any]) -> str:
    d, g, n = got["distill_step"], got["grpo_step"], got["grpo_steps_run"]
    if d is None:
        return "distill never within 5 points of the teacher: goal NOT met"
    head = f"distill within 5 points of the teacher at step {d} ({got['distill_accuracy']:.1%})"
    if g is None:
        met = "goal met" if n >= RATIO * d else "undecided"
        tail = f"grpo not there in its {n} steps ({met}: >= {RATIO}x)"
    else:
        tail = f"grpo there at step {g} ({'goal met' if g >= RATIO * d else 'goal NOT met'})"
    return f"{head}; {tail}"


def report(got: dict[str, Any]) -> str:
    acc, curves = got["accuracy"], got["curves"]
    steps = sorted(set(curves["distill"]) | set(curves["grpo"]))
    cell = lambda c, s: "-" if c.get(s) is None else f"{100 * c[s]:.1f}"  # noqa: E731
    row = lambda n, c: f"  {n:<8} " + " ".join(f"{cell(c, s):>5}" for s in steps)  # noqa: E731
    return "\n".join(
        [
            "held-out accuracy (evaluate, greedy):",
            *(f"  {name:<8} {100 * a:5.1f}%" for name, a in acc.items()),
            "held-out accuracy by step (%):",
            "  step     " + " ".join(f"{s:>5}" for s in steps),
            *(row(n, c) for n, c in curves.items()),
            f"rl stage seconds: {got['rl_seconds']}",
            verdict(got),
        ]
    )


def plot(got: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, points in got["curves"].items():
        ax.plot(list(points), [100 * a for a in points.values()], marker="o", label=name)
    teacher = 100 * got["accuracy"]["teacher"]
    ax.axhline(teacher, color="black", linestyle="--", label="teacher (RFT)")
    ax.axhline(teacher - 100 * WITHIN, color="grey", linestyle=":", label="teacher - 5 points")
    ax.set(
        title="chain_sum, same student: held-out greedy accuracy",
        xlabel="RL step",
        ylabel="accuracy (%)",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "distill_quickstart")
    parser.add_argument("--report", action="store_true", help="read the run folder, run nothing")
    args = parser.parse_args(argv)
    if not args.report:
        cmd = [sys.executable, "-m", "engine.cli", "run", PIPELINE, "--run-dir", str(args.run_dir)]
        subprocess.run(cmd, cwd=ROOT, env=ENV, check=True)
    got = figures(args.run_dir)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(got, indent=2) + "\n")
    plot(got, OUT / "distill.png")
    print(report(got))
    print(f"written: {OUT / 'results.json'}, {OUT / 'distill.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
