"""Benchmark: the rl stage's algorithms side by side, held-out accuracy at steps 50..250.

    .venv/bin/python bench/algorithms.py [--tasks quickstart,variant] [--arms grpo,dr_grpo,...]
        [--steps 250] [--parallel 2] [--seeds 0,1,2]
    .venv/bin/python bench/algorithms.py --trl [--trl-seeds 0,1,2]

Every arm starts from the same warm-up (the GRPO quickstart's data and warmup stages, made
once per task in bench/out/algos/base-TASK) and runs the quickstart's grpo stage with its
settings (64 prompts x 8 samples, lr 2e-4 cosine, 8 new tokens), the same seed, changing
only what the arm names (`ARMS`). Tasks: `quickstart` (chain_sum, 2 terms of 2 digits) and
`variant` (3 terms of 1-2 digits), and `hard` (3 terms of 2 digits; not in the default
`--tasks`). Printed: per task, the held-out greedy accuracy (500
prompts) at the start and every 50 steps, seconds per step and prompts drawn per step;
written: bench/out/algos/results.json and algorithms.png (accuracy against steps).

With --trl: the target of issue 39 on bench/rl.py's comparison (8 prompts x 4 samples, lr
1e-4 constant after 10 warm-up steps, the quickstart's warm-up): TRL GRPOTrainer's held-out
accuracy after 100 steps, and the first step (of every 10) at which our default settings
reach it, per sampling seed.

With --equal-cost: the default judged at equal cost (issue 45): `grpo` (dynamic sampling off,
the default since) against `dynamic` (on, the default before), every task, seeds 0-2,
held-out accuracy every 10 steps; each pair (task, seed) compared at the generated tokens of
the cheaper arm's last step and at its wall time (each arm's accuracy at its last evaluation
within that budget), and at equal steps.
Written: bench/out/algos/equal_cost.json and equal_cost.png (accuracy against tokens).

`pipe run` caches each arm's stage in its run folder, so running the bench again prints the
table without re-running an arm whose settings and code did not change; `--report` prints
and plots from the run folders as they are, running nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.rl import ENV, PIPE  # noqa: E402

OUT = ROOT / "bench" / "out" / "algos"
TASKS = {
    "quickstart": {},
    "variant": {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 2},
    "hard": {"min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 2},
}
# each arm: the grpo stage's settings it changes, explicit even where they are the default
# (`grpo` is the default); the rest are the quickstart's
OFF = {"dynamic_sampling": False}  # the default (issue 45: it did not lead at equal cost)
ARMS: dict[str, dict[str, Any]] = {
    "grpo": {"advantage": "grpo", **OFF},
    "dr_grpo": {"advantage": "dr_grpo", **OFF},
    "rloo": {"advantage": "rloo", **OFF},
    "reinforce_pp": {"advantage": "reinforce_pp", **OFF},
    # DAPO's dynamic sampling alone, on GRPO's estimator (the default from issue 39 to 45)
    "dynamic": {"advantage": "grpo", "dynamic_sampling": True},
    # DAPO's four: clip-higher (its 0.28), dynamic sampling, token-level loss (token_mean,
    # the default), overlong shaping (4 of the 8 answer tokens; the answers need 2-5)
    "dapo": {
        "advantage": "grpo",
        "eps_clip_high": 0.28,
        "dynamic_sampling": True,
        "overlong_buffer": 4,
    },
    # GSPO as users get it: ratio_level sequence brings its clip range (3e-4, 4e-4) and
    # per-sequence mean loss (stages.rl.algo.combinations.gspo_defaults)
    "gspo": {"advantage": "grpo", "ratio_level": "sequence", **OFF},
}
LOCK = threading.Lock()
REPORT = False  # --report: read the arms' run folders, run nothing


def run(args: list[str], log: Path) -> None:
    import subprocess

    with open(log, "w") as f:
        subprocess.run(args, cwd=ROOT, env=ENV, check=True, stdout=f, stderr=subprocess.STDOUT)


def base(task: str) -> Path:
    """The task's data and warm-up, made once."""
    out = OUT / f"base-{task}"
    if not (out / "warmup" / "checkpoint" / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        sets = ["--set", f"stages.data.config.task_config={json.dumps(TASKS[task])}"] * bool(
            TASKS[task]
        )
        run(
            [
                *PIPE,
                "run",
                "pipelines/grpo_quickstart.yaml",
                "--only",
                "data",
                "--only",
                "warmup",
                "--run-dir",
                str(out),
                *sets,
            ],
            out / "bench.log",
        )
    return out


def arm(
    task: str, name: str, b: Path, steps: int, extra: dict[str, Any], seed: int = 0
) -> list[dict[str, Any]]:
    """One arm's grpo stage from the task's warm-up (with the rl stage's `seed`: sampling and
    data order; the warm-up is the same); its metrics.jsonl rows."""
    out = OUT / (f"{task}-{name}" + (f"-s{seed}" if seed else ""))
    settings = {"max_steps": steps, **ARMS[name], **extra, **({"seed": seed} if seed else {})}
    rows = grpo_stage(out, b, settings)
    result = json.loads((out / "grpo/rl_result.json").read_text())
    return [{"step": 0, "eval_accuracy": result.get("eval_accuracy_start")}, *rows]


def grpo_stage(out: Path, b: Path, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The quickstart's grpo stage in run folder `out` from base `b`'s warm-up and data,
    with `settings` over the yaml's; its metrics.jsonl rows."""
    out.mkdir(parents=True, exist_ok=True)
    sets = {
        "model": b / "warmup/checkpoint",
        "input": b / "data/train.jsonl",
        "eval_input": b / "data/test.jsonl",
        **settings,
    }
    args = [*PIPE, "run", "pipelines/grpo_quickstart.yaml", "--only", "grpo", "--run-dir", str(out)]
    for k, v in sets.items():
        args += ["--set", f"stages.grpo.config.{k}={json.dumps(v) if isinstance(v, bool) else v}"]
    if not REPORT:
        run(args, out / "bench.log")
    return [json.loads(x) for x in (out / "grpo/metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict[str, Any]], every: int) -> dict[str, Any]:
    trained = [r for r in rows if r["step"] > 0]
    timed = [r for r in trained if r["eval_accuracy"] is None] or trained
    return {
        "accuracy": {r["step"]: r["eval_accuracy"] for r in rows if r["step"] % every == 0},
        "s_per_step": sum(r["step_s"] for r in timed) / len(timed),
        "prompts_per_step": sum(r.get("prompts_drawn") or len(r["prompts"]) for r in trained)
        / len(trained),
        "groups_kept": sum(r["groups_kept"] for r in trained) / len(trained),
    }


def mean_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Seeds' summaries as one: each figure's mean (accuracy step by step)."""
    if len(runs) == 1:
        return runs[0]
    acc = {s: sum(r["accuracy"][s] for r in runs) / len(runs) for s in runs[0]["accuracy"]}
    rest = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0] if k != "accuracy"}
    return {"accuracy": acc, **rest}


def table(results: dict[str, dict[str, Any]], task: str, steps: list[int]) -> str:
    head = ["arm", *[f"step {s}" for s in steps], "gain", "s/step", "prompts/step", "groups kept"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        acc = r["accuracy"]
        cells = [f"{acc[s]:.1%}" if acc.get(s) is not None else "-" for s in steps]
        gain = (acc.get(steps[-1]) or 0.0) - (acc.get(0) or 0.0)
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {100 * gain:+.1f} | {r['s_per_step']:.2f} | "
            f"{r['prompts_per_step']:.1f} | {r['groups_kept']:.1f} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
    for ax, (task, arms) in zip(axes[0], results.items(), strict=True):
        for name, r in arms.items():
            pts = sorted((int(s), a) for s, a in r["accuracy"].items() if a is not None)
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=name)
        ax.set(title=f"{task}: held-out greedy accuracy", xlabel="RL step", ylabel="accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", default="quickstart,variant")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--every", type=int, default=50, help="held-out evaluation interval")
    p.add_argument("--parallel", type=int, default=2, help="arms run at once (one core each)")
    p.add_argument("--seeds", default="0", help="the rl stage's seeds per arm; tables show means")
    p.add_argument("--trl", action="store_true", help="the 8 x 4 target against TRL instead")
    p.add_argument(
        "--equal-cost",
        action="store_true",
        help="grpo against dynamic at equal generated tokens and wall time (tasks, seeds 0-2)",
    )
    p.add_argument("--trl-seeds", default="0,1,2")
    p.add_argument(
        "--report",
        action="store_true",
        help="print and plot from the arms' run folders without running them (pipe run would "
        "run an arm again once the rl stage's code changed: its cache key has the code version)",
    )
    args = p.parse_args()
    global REPORT
    REPORT = args.report
    if args.trl:
        names = args.arms.split(",") if args.arms != ",".join(ARMS) else ["default"]
        return trl_target([int(s) for s in args.trl_seeds.split(",")], names)
    tasks, names = args.tasks.split(","), args.arms.split(",")
    seeds = [int(x) for x in args.seeds.split(",")]
    if args.equal_cost:
        tasks = tasks if args.tasks != "quickstart,variant" else list(TASKS)
        seeds = seeds if args.seeds != "0" else [0, 1, 2]
        return equal_cost(tasks, seeds, args.steps, args.parallel)
    bases = {t: base(t) for t in tasks}
    jobs = [(t, n, sd) for t in tasks for n in names for sd in seeds]
    done: dict[tuple[str, str, int], dict[str, Any]] = {}
    began = time.perf_counter()

    def one(job: tuple[str, str, int]) -> None:
        t, n, sd = job
        rows = arm(t, n, bases[t], args.steps, {"eval_every": args.every}, sd)
        with LOCK:
            done[job] = summary(rows, args.every)
            spent = time.perf_counter() - began
            print(
                f"[{len(done)}/{len(jobs)}] {t} {n} seed {sd}: held-out {done[job]['accuracy']} "
                f"({spent / len(done):.0f} s per arm, "
                f"eta {spent / len(done) * (len(jobs) - len(done)):.0f} s)",
                flush=True,
            )

    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(one, jobs))
    steps = list(range(0, args.steps + 1, args.every))
    ordered = {t: {n: mean_of([done[(t, n, sd)] for sd in seeds]) for n in names} for t in tasks}
    for t in tasks:
        print(f"\n{t} ({json.dumps(TASKS[t]) if TASKS[t] else 'the quickstart task'}):")
        print(table(ordered[t], t, steps))
        if len(seeds) > 1:
            for n in names:
                gains = [done[(t, n, sd)]["accuracy"] for sd in seeds]
                cells = ", ".join(f"{100 * (g[args.steps] - g[0]):+.1f}" for g in gains)
                print(f"  {n}: gain per seed ({args.seeds}) {cells}")
    (OUT / "results.json").write_text(json.dumps(ordered, indent=1))
    plot(ordered, OUT / "algorithms.png")
    print(f"\nwrote {OUT / 'results.json'} and {OUT / 'algorithms.png'}")


def curve(rows: list[dict[str, Any]]) -> list[tuple[float, float, int, float]]:
    """An arm's held-out evaluations as (generated tokens, wall seconds, step, accuracy), the
    cost summed over the steps up to each; step 0 costs nothing."""
    tokens = seconds = 0.0
    points = []
    for r in rows:
        if r["step"] > 0:
            tokens += r.get("tokens_generated") or r["tokens_per_s"] * r["gen_s"]
            seconds += r["step_s"]
        if r.get("eval_accuracy") is not None:
            points.append((tokens, seconds, r["step"], r["eval_accuracy"]))
    return points


def at_budget(points: list[tuple[float, float, int, float]], axis: int, budget: float) -> float:
    """Accuracy at the last evaluation whose cost on `axis` (0 tokens, 1 seconds, 2 steps) is
    within `budget`."""
    return [p[3] for p in points if p[axis] <= budget * (1 + 1e-9)][-1]


def equal_cost(tasks: list[str], seeds: list[int], steps: int, parallel: int) -> None:
    """`grpo` (dynamic sampling off) against `dynamic` (on), every task and seed: held-out
    accuracy at equal generated tokens, equal wall time and equal steps, side by side."""
    names = ["grpo", "dynamic"]
    bases = {t: base(t) for t in tasks}
    jobs = [(t, sd, n) for t in tasks for sd in seeds for n in names]  # each pair together
    points: dict[tuple[str, int, str], list[tuple[float, float, int, float]]] = {}
    began = time.perf_counter()

    def one(job: tuple[str, int, str]) -> None:
        t, sd, n = job
        rows = arm(t, n, bases[t], steps, {"eval_every": 10}, sd)
        with LOCK:
            points[job] = curve(rows)
            spent = time.perf_counter() - began
            last = points[job][-1]
            print(
                f"[{len(points)}/{len(jobs)}] {t} seed {sd} {n}: {last[3]:.1%} after {last[2]} "
                f"steps, {last[0]:,.0f} tokens, {last[1]:.0f} s ({spent / len(points):.0f} s "
                f"per arm, eta {spent / len(points) * (len(jobs) - len(points)):.0f} s)",
                flush=True,
            )

    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(one, jobs))
    results: dict[str, Any] = {}
    for t in tasks:
        per_seed = []
        for sd in seeds:
            a, b = (points[(t, sd, n)] for n in names)
            row = {"seed": sd, "start": a[0][3]}
            for label, axis in (("tokens", 0), ("seconds", 1), ("steps", 2)):
                budget = min(a[-1][axis], b[-1][axis])
                row[label] = {
                    "budget": budget,
                    **{n: at_budget(points[(t, sd, n)], axis, budget) for n in names},
                }
            per_seed.append(row)
        results[t] = per_seed
        print(f"\n{t} ({json.dumps(TASKS[t]) if TASKS[t] else 'the quickstart task'}):")
        print(
            "| seed | start | "
            + " | ".join(
                f"{n} @ equal {lab}" for lab in ("tokens", "seconds", "steps") for n in names
            )
            + " |"
        )
        print("|" + "---|" * (2 + 3 * len(names)))
        for r in per_seed:
            cells = [f"{r[lab][n]:.1%}" for lab in ("tokens", "seconds", "steps") for n in names]
            print(f"| {r['seed']} | {r['start']:.1%} | " + " | ".join(cells) + " |")
        means = {
            lab: {n: sum(r[lab][n] for r in per_seed) / len(per_seed) for n in names}
            for lab in ("tokens", "seconds", "steps")
        }
        cells = [f"{means[lab][n]:.1%}" for lab in ("tokens", "seconds", "steps") for n in names]
        print(
            "| mean | "
            + f"{sum(r['start'] for r in per_seed) / len(per_seed):.1%} | "
            + " | ".join(cells)
            + " |"
        )
        for lab in ("tokens", "seconds"):
            lead = max(names, key=lambda n: means[lab][n])
            print(
                f"  at equal {lab}: {lead} leads by "
                f"{100 * abs(means[lab]['dynamic'] - means[lab]['grpo']):.1f} points (mean)"
            )
    (OUT / "equal_cost.json").write_text(json.dumps(results, indent=1))
    plot_cost(points, tasks, seeds, names, OUT / "equal_cost.png")
    print(f"\nwrote {OUT / 'equal_cost.json'} and {OUT / 'equal_cost.png'}")


def plot_cost(
    points: dict, tasks: list[str], seeds: list[int], names: list[str], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.2), squeeze=False)
    for ax, t in zip(axes[0], tasks, strict=True):
        for color, n in zip(("tab:blue", "tab:orange"), names, strict=False):
            for sd in seeds:
                pts = points[(t, sd, n)]
                ax.plot(
                    [p[0] / 1e3 for p in pts],
                    [100 * p[3] for p in pts],
                    color=color,
                    alpha=0.8,
                    label=n if sd == seeds[0] else None,
                )
        ax.set(
            title=f"{t}: held-out accuracy",
            xlabel="generated tokens (thousands)",
            ylabel="accuracy (%)",
        )
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def trl_target(seeds: list[int], names: list[str]) -> None:
    """TRL's 100-step accuracy at 8 x 4 beside the step at which ours reaches it, with our
    default settings (`default`) or the arms named."""
    from bench.rl import Arm, accuracy, trl
    from bench.rl import base as rl_base

    b = rl_base(0)
    python = str(ROOT / ".venv-trl/bin/python")
    trl_acc: list[float] = []
    curves: dict[str, list[dict[int, float]]] = {}
    for seed in seeds:
        a = Arm(8, 4, 100, 1e-4, "constant", seed)
        theirs_at = OUT / f"trl-8x4-s{seed}.json"
        if not theirs_at.exists() and not REPORT:
            theirs_at.write_text(
                json.dumps(accuracy(trl(b, f"trl-8x4-s{seed}", a, python)["checkpoint"], b))
            )
        theirs = json.loads(theirs_at.read_text())
        trl_acc.append(theirs)
        for name in names:
            curves.setdefault(name, []).append(ours_8x4(b, seed, name, theirs))
    target = sum(trl_acc) / len(trl_acc)
    print(f"\nmeans over seeds {seeds}: TRL after 100 steps {target:.1%}")
    summary_rows = {}
    for name, runs in curves.items():
        mean = {s: sum(r[s] for r in runs) / len(runs) for s in sorted(runs[0])}
        reach = next((s for s, acc in mean.items() if acc >= target), None)
        summary_rows[name] = {"mean": mean, "reach": reach}
        print(
            f"  ours ({name}): "
            + ", ".join(f"{s}: {acc:.1%}" for s, acc in mean.items())
            + f"; reaches TRL's 100-step mean at step {reach}"
        )
    (OUT / "trl_target.json").write_text(
        json.dumps({"seeds": seeds, "trl": trl_acc, "ours": summary_rows}, indent=1)
    )
    plot_target(summary_rows, target, OUT / "trl_target.png")
    print(f"wrote {OUT / 'trl_target.json'} and {OUT / 'trl_target.png'}")


def plot_target(rows: dict[str, Any], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, r in rows.items():
        pts = sorted((int(s), a) for s, a in r["mean"].items())
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=name)
    ax.axhline(100 * target, color="black", linestyle="--", label="TRL GRPOTrainer, step 100")
    ax.set(
        title="8 x 4 samples a step, lr 1e-4: held-out accuracy (mean over seeds)",
        xlabel="RL step",
        ylabel="accuracy (%)",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def ours_8x4(b: Path, seed: int, name: str, theirs: float) -> dict[int, float]:
    """One of our runs at bench/rl.py's 8 x 4 settings, held-out every 10 steps."""
    settings = {
        "rollout_batch_size": 8,
        "num_repeats": 4,
        "train_batch_size": 32,
        "micro_train_batch_size": 32,
        "max_steps": 100,
        "eval_every": 10,
        "save_steps": 100,
        "learning_rate": 1e-4,
        "lr_scheduler": "constant",
        "seed": seed,
        **(ARMS[name] if name != "default" else {}),
    }
    rows = grpo_stage(OUT / f"ours-8x4-{name}-s{seed}", b, settings)
    curve = {r["step"]: r["eval_accuracy"] for r in rows if r["eval_accuracy"] is not None}
    reach = next((s for s, acc in sorted(curve.items()) if acc >= theirs), None)
    print(
        f"seed {seed}: TRL after 100 steps {theirs:.1%}; ours ({name}) "
        + ", ".join(f"{s}: {acc:.1%}" for s, acc in sorted(curve.items()))
        + f"; ours reaches TRL's at step {reach}",
        flush=True,
    )
    return curve


if __name__ == "__main__":
    main()
