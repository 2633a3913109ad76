"""Benchmark: a reward model from the quickstart's own rollouts, and GRPO on its scores alone.

    .venv/bin/python bench/reward_model.py [--run-dir DIR] [--set KEY=VALUE ...] [--smoke]

Runs pipelines/rm_quickstart.yaml at full size through `pipe run` (data -> warm-up ->
collect -> pairs -> rm -> GRPO rewarded by the rm alone -> evaluate; a rerun reuses what is
cached) and prints the issue's two goals: the reward model's pairwise accuracy on the pairs
of held-out prompts (goal >= 90%), and the held-out verifier accuracy (greedy, the 500 test
prompts, evaluate's) of the warm-up beside the GRPO policy trained on the reward model alone
(goal >= +5 points), each checkpoint's mean reward-model score beside it (a score that climbs
while accuracy does not: over-optimisation). Copies the rl stage's plot of reward-model score
and verifier accuracy per step to bench/out/reward_model/rm_rl.png and writes the figures to
bench/out/reward_model/results.json. `--smoke`: the sizes of
tests/integration/test_rm_pipeline.py (a check that the command works, not a measurement);
`--set`: further overrides, as `pipe run --set`; `--only STAGE`: as `pipe run --only` (the
earlier stages as the run folder has them, e.g. the rl stage again with other settings).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "out" / "reward_model"
PIPELINE = "pipelines/rm_quickstart.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
RM_GOAL, GAIN_GOAL = 0.90, 0.05


def run(run_dir: Path, overrides: list[str], only: list[str]) -> None:
    cmd = [sys.executable, "-m", "engine.cli", "run", PIPELINE, "--run-dir", str(run_dir)]
    for item in overrides:
        cmd += ["--set", item]
    for stage in only:
        cmd += ["--only", stage]
    subprocess.run(cmd, cwd=ROOT, env=ENV, check=True)


def read(path: Path) -> Any:
    return json.loads(path.read_text())


def figures(run_dir: Path) -> dict[str, Any]:
    """What the run measured: the rm's held-out pairwise accuracy, each checkpoint's held-out
    accuracy and mean reward-model score, the rl stage's own held-out accuracy first -> last."""
    rm = read(run_dir / "rm" / "metrics.json")
    rl = read(run_dir / "grpo" / "rl_result.json")
    evaluation = read(run_dir / "evaluate" / "report.json")
    checkpoints = {
        r["checkpoint"]: {
            "n": r["n"],
            "accuracy": r["accuracy"],
            "reward_model_score": r.get("reward_model_score"),
        }
        for r in evaluation["results"]
    }
    pairs = run_dir / "pairs_heldout" / "filtered.jsonl"
    return {
        "rm_pairwise_accuracy": rm.get("eval_accuracy"),
        "rm_heldout_pairs": sum(1 for _ in pairs.open()) if pairs.exists() else None,
        "rm_steps": rm.get("steps"),
        "checkpoints": checkpoints,
        "gain": checkpoints["grpo"]["accuracy"] - checkpoints["warmup"]["accuracy"],
        "rl_steps": rl.get("steps"),
        "rl_eval_accuracy_start": rl.get("eval_accuracy_start"),
        "rl_eval_accuracy_end": rl.get("eval_accuracy_end"),
        "rl_seconds": rl.get("seconds"),
    }


def score(checkpoint: dict[str, Any]) -> str:
    value = checkpoint["reward_model_score"]
    return "-" if value is None else f"{value:.3f}"


def verdict(value: float | None, goal: float) -> str:
    return "-" if value is None else ("goal met" if value >= goal else "goal NOT met")


def report(got: dict[str, Any]) -> str:
    acc, ckpt = got["rm_pairwise_accuracy"], got["checkpoints"]
    warm, grpo = ckpt["warmup"], ckpt["grpo"]
    lines = [
        f"reward model: held-out pairwise accuracy {acc:.1%} on {got['rm_heldout_pairs']} pairs "
        f"({verdict(acc, RM_GOAL)}: >= {RM_GOAL:.0%})",
        "held-out verifier accuracy (evaluate, greedy):",
        f"  {'checkpoint':<10} {'n':>5} {'accuracy':>9} {'rm score':>9}",
        *(
            f"  {name:<10} {c['n']:>5} {c['accuracy']:>9.1%} {score(c):>9}"
            for name, c in (("warmup", warm), ("grpo", grpo))
        ),
        f"GRPO on the reward model alone: {got['gain'] * 100:+.1f} points over the warm-up "
        f"({verdict(got['gain'], GAIN_GOAL)}: >= +{GAIN_GOAL * 100:.0f}) after "
        f"{got['rl_steps']} steps",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, default=OUT / "run")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--smoke", action="store_true", help="the integration test's sizes")
    parser.add_argument("--only", action="append", default=[], metavar="STAGE")
    args = parser.parse_args(argv)
    overrides = list(args.set)
    if args.smoke:
        from tests.integration.test_rm_pipeline import SHRINK

        overrides = [*SHRINK, *overrides]
    run(args.run_dir, overrides, args.only)
    got = figures(args.run_dir)
    OUT.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(args.run_dir / "grpo" / "rl.png", OUT / "rm_rl.png")
    got["smoke"], got["overrides"] = args.smoke, overrides
    (OUT / "results.json").write_text(json.dumps(got, indent=2) + "\n")
    print(report(got))
    print(f"written: {OUT / 'results.json'}")
    print(f"plot of reward-model score and verifier accuracy per step: {OUT / 'rm_rl.png'}")
    if args.smoke:
        print("smoke sizes: a check that the command works, not a measurement")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
