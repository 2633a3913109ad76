"""Benchmark: our GRPO (the rl stage) beside TRL's GRPOTrainer, same warm-up and settings.

    .venv/bin/python bench/rl.py [--shapes 8x4,32x4] [--steps 100] [--lr 1e-4] [--repeats 3]
        [--schedule cosine]
    .venv/bin/python bench/rl.py --async [--shapes 32x8] [--steps 60]
    .venv/bin/python bench/rl.py --packing [--samples 512] [--micro 128] [--rounds 5]
    .venv/bin/python bench/rl.py --gemma3 [--steps 300] [--threads 2]

Both start from the warm-up of pipelines/grpo_quickstart.yaml (made once in
bench/out/rl/base: its data and warmup stages), take the same prompts, group size,
prompts per step, learning rate (with 10% warm-up), step count and answer length, one
update per step, no KL, temperature 1; one torch thread each. Printed side by side in
one run: seconds per step of the training loop (start-up and the final held-out
evaluation excluded), ours / TRL (with --async: sync / async, the speed-up), and
the held-out greedy accuracy of both final checkpoints on the 500 test prompts, scored
by the same code. TRL runs in `.venv-trl` (make bench-rl-setup). With --async: our
synchronous and asynchronous modes side by side instead. `--repeats N` runs each side N
times per shape with sampling seeds 0..N-1 (same warm-up) and prints their means too: one
run's held-out accuracy moves by a few points with the seed alone. With --packing: the
actor's update on packed micro batches beside padded ones (bench/rl_packing.py).

With --gemma3 (`make gemma3` first; hours on a CPU): pipelines/gemma3_grpo.yaml's data and SFT
(made once in bench/out/rl/gemma3), then its grpo stage (LoRA, bf16) for --steps steps,
held-out accuracy on 200 test prompts every `eval_every` steps of the file, then TRL's
GRPOTrainer on the same SFT checkpoint, data, LoRA, batch, schedule (over --steps) and threads
for as much training wall time, or --steps steps if fewer (bench/rl_trl.py --gemma3), scored
every 10 minutes and where it stops; printed: accuracy against training wall time, both sides,
and at each 10-minute mark both ran to, each side's latest score at or before it.
`--run-dir`: another run folder; `--reuse-ours`: our side as that folder's completed grpo stage
has it (TRL's side only is run); `--trl-minutes`: TRL's budget instead of ours.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "out" / "rl"
PIPE = [sys.executable, "-m", "engine.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def base(seed: int) -> Path:
    """The warm-up and data, made once."""
    run = OUT / f"base-{seed}"
    if not (run / "warmup" / "checkpoint" / "config.json").exists():
        subprocess.run(
            [
                *PIPE,
                "run",
                "pipelines/grpo_quickstart.yaml",
                "--only",
                "data",
                "--only",
                "warmup",
                "--run-dir",
                str(run),
                "--set",
                f"defaults.seed={seed}",
            ],
            cwd=ROOT,
            env=ENV,
            check=True,
        )
    return run


@dataclass(frozen=True)
class Arm:
    """What both sides of one comparison share: the shape, the rate and the sampling seed."""

    prompts: int
    group: int
    steps: int
    lr: float
    schedule: str
    seed: int


def ours(b: Path, name: str, arm: Arm, extra: Sequence[str] = ()) -> dict[str, Any]:
    run = OUT / name
    prompts, group, steps = arm.prompts, arm.group, arm.steps
    sets = {
        "model": b / "warmup/checkpoint",
        "input": b / "data/train.jsonl",
        "eval_input": b / "data/test.jsonl",
        "rollout_batch_size": prompts,
        "num_repeats": group,
        "train_batch_size": prompts * group,
        "micro_train_batch_size": prompts * group,
        "max_steps": steps,
        "eval_every": steps,
        "save_steps": steps,
        "learning_rate": arm.lr,
        "lr_scheduler": arm.schedule,  # as TRL's side, whatever the pipeline says
        "seed": arm.seed,
    }
    args = [
        *PIPE,
        "run",
        "pipelines/grpo_quickstart.yaml",
        "--only",
        "grpo",
        "--force",
        "--run-dir",
        str(run),
    ]
    for k, v in sets.items():
        args += ["--set", f"stages.grpo.config.{k}={v}"]
    for item in extra:
        args += ["--set", f"stages.grpo.config.{item}"]
    subprocess.run(args, cwd=ROOT, env=ENV, check=True, capture_output=True)
    rows = [json.loads(x) for x in (run / "grpo/metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["eval_accuracy"] is None] or rows  # the held-out eval is apart
    return {
        "s_per_step": sum(r["step_s"] for r in rows) / len(rows),
        "samples": sum(r["samples_trained"] for r in rows),
        "checkpoint": run / "grpo/checkpoint",
    }


def trl(b: Path, name: str, arm: Arm, python: str) -> dict[str, Any]:
    out = OUT / name
    subprocess.run(
        [
            python,
            str(ROOT / "bench/rl_trl.py"),
            "--model",
            str(b / "warmup/checkpoint"),
            "--train",
            str(b / "data/train.jsonl"),
            "--out",
            str(out),
            "--prompts",
            str(arm.prompts),
            "--group",
            str(arm.group),
            "--steps",
            str(arm.steps),
            "--lr",
            str(arm.lr),
            "--max-tokens",
            "8",
            "--seed",
            str(arm.seed),
            "--schedule",
            arm.schedule,
        ],
        cwd=ROOT,
        env={**ENV, "PYTHONPATH": ""},
        check=True,
        capture_output=True,
    )
    result = json.loads((out / "trl_result.json").read_text())
    return {"s_per_step": result["seconds_per_step"], "checkpoint": out}


def accuracy(checkpoint: Path, b: Path) -> float:
    """Greedy accuracy on the 500 test prompts, scored like the evaluate stage does."""
    from stages.evaluate import EvaluateConfig
    from stages.evaluate.run import Generator
    from stages.lib.io.jsonl import read_jsonl
    from stages.lib.verify import make_verifier

    cfg = EvaluateConfig(max_output_tokens=8)
    rows = list(read_jsonl(str(b / "data/test.jsonl")))
    verify = make_verifier(cfg.verifier)
    gens = Generator(cfg)(str(checkpoint), [r["prompt"] for r in rows], 1)
    return sum(verify(r, g[0].text) >= 1.0 for r, g in zip(rows, gens, strict=True)) / len(rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8x4,32x4")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0, help="the warm-up's seed")
    p.add_argument(
        "--schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="both sides' schedule after the 10%% warm-up: constant, or cosine to a tenth",
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="runs of each side per shape, sampling seeds 0..N-1"
    )
    p.add_argument("--async", dest="asynchronous", action="store_true")
    p.add_argument("--trl-python", default=str(ROOT / ".venv-trl/bin/python"))
    p.add_argument("--packing", action="store_true", help="packed vs padded actor updates")
    p.add_argument("--samples", type=int, default=512, help="--packing: samples per step")
    p.add_argument("--micro", type=int, default=128, help="--packing: samples per micro batch")
    p.add_argument("--rounds", type=int, default=5, help="--packing: steps of each layout")
    p.add_argument("--gemma3", action="store_true", help="Gemma 3 270M, LoRA: accuracy vs time")
    p.add_argument("--threads", type=int, default=2, help="--gemma3: torch threads, both sides")
    p.add_argument("--run-dir", type=Path, default=OUT / "gemma3", help="--gemma3: the run folder")
    p.add_argument(
        "--reuse-ours",
        action="store_true",
        help="--gemma3: our side as the run folder's completed grpo stage has it (TRL's runs)",
    )
    p.add_argument("--trl-minutes", type=float, help="--gemma3: TRL's budget (default: ours)")
    args = p.parse_args()
    if args.gemma3:
        gemma3(args, args.trl_python)
        return
    if args.packing:
        from bench.rl_packing import main as packing

        packing(args.samples, args.micro, args.rounds)
        return
    b = base(args.seed)
    start = accuracy(b / "warmup/checkpoint", b)
    print(f"warm-up (seed {args.seed}): held-out accuracy {start:.3f}")
    ratio = "B/A" if args.asynchronous else "A/B"  # async: the speed-up of async over sync
    header = ("shape", "run seed", "A s/step", "B s/step", ratio, "A acc", "B acc")
    names = ("ours async", "ours sync") if args.asynchronous else ("ours", "TRL")
    print(f"A = {names[0]}, B = {names[1]}; {args.steps} steps, lr {args.lr} {args.schedule}")
    print("  ".join(f"{h:>10}" for h in header))
    for shape in args.shapes.split(","):
        prompts, group = (int(x) for x in shape.split("x"))
        runs = []
        for r in range(args.repeats):
            tag = shape if args.repeats == 1 else f"{shape}-s{r}"
            tag += "" if args.schedule == "constant" else f"-{args.schedule}"
            arm = Arm(prompts, group, args.steps, args.lr, args.schedule, r)
            if args.asynchronous:
                a = ours(b, f"async-{tag}", arm, ["async_train=true"])
                o = ours(b, f"sync-{tag}", arm)
            else:
                a = ours(b, f"ours-{tag}", arm)
                o = trl(b, f"trl-{tag}", arm, args.trl_python)
            runs.append(
                (
                    a["s_per_step"],
                    o["s_per_step"],
                    accuracy(a["checkpoint"], b),
                    accuracy(o["checkpoint"], b),
                )
            )
            print(_row(shape, str(r), runs[-1], args.asynchronous), flush=True)
        if args.repeats > 1:
            means = [sum(col) / len(col) for col in zip(*runs, strict=True)]
            print(_row(shape, "mean", means, args.asynchronous), flush=True)


GEMMA3_LR = 1e-4  # pipelines/gemma3_grpo.yaml's grpo learning_rate, set on both sides


def gemma3(args: argparse.Namespace, python: str) -> None:
    """--gemma3 (module docstring)."""
    steps, threads, run = args.steps, args.threads, args.run_dir
    grpo = ["--only", "grpo", "--force", "--run-dir", str(run)]
    env = {**ENV, "OMP_NUM_THREADS": str(threads)}
    pipeline = "pipelines/gemma3_grpo.yaml"
    if not (run / "sft" / "checkpoint" / "config.json").exists():
        only = ["--only", "data", "--only", "sft", "--run-dir", str(run)]
        subprocess.run([*PIPE, "run", pipeline, *only], cwd=ROOT, env=env, check=True)
    # eval_every and the rest as the pipeline has them
    sets = {"max_steps": steps, "num_threads": threads, "save_steps": steps}
    sets["learning_rate"] = GEMMA3_LR  # and TRL's
    cmd = [*PIPE, "run", pipeline, *grpo]
    for k, v in sets.items():
        cmd += ["--set", f"stages.grpo.config.{k}={v}"]
    if not args.reuse_ours:
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    rows = [json.loads(x) for x in (run / "grpo/metrics.jsonl").read_text().splitlines()]
    spent, ours_marks = 0.0, []
    result = json.loads((run / "grpo/rl_result.json").read_text())
    if result["resumed_from_step"] is None and result["eval_accuracy_start"] is not None:
        ours_marks.append((0.0, 0, result["eval_accuracy_start"]))  # before training, as TRL's
    # a scored step's step_s holds its held-out evaluation too (TRL's clock stops for its
    # marks): such a step counts as the mean of the others
    plain = [r["step_s"] for r in rows if r.get("eval_accuracy") is None]
    usual = sum(plain) / max(len(plain), 1)
    for r in rows:
        scored = r.get("eval_accuracy") is not None
        spent += usual if scored and plain else r["step_s"]
        if scored:
            ours_marks.append((spent / 60, r["step"], r["eval_accuracy"]))
    out = OUT / "gemma3-trl"
    data = run / "data"
    cmd = [
        python,
        str(ROOT / "bench/rl_trl.py"),
        "--gemma3",
        "--model",
        str(run / "sft/checkpoint"),
    ]
    cmd += ["--train", str(data / "train.jsonl"), "--eval", str(data / "test.jsonl")]
    minutes = args.trl_minutes if args.trl_minutes is not None else spent / 60
    cmd += ["--out", str(out), "--minutes", f"{minutes:.2f}", "--threads", str(threads)]
    cmd += ["--steps", str(steps), "--lr", str(GEMMA3_LR)]  # our schedule's length and lr
    subprocess.run(cmd, cwd=ROOT, env={**env, "PYTHONPATH": ""}, check=True)
    theirs = json.loads((out / "trl_result.json").read_text())["marks"]
    print("side     minutes   step  held-out accuracy")
    for minutes, step, acc in ours_marks:
        print(f"ours  {minutes:>10.1f}{step:>7}{acc:>19.3f}")
    for m in theirs:
        print(f"TRL   {m['minutes']:>10.1f}{m['step']:>7}{m['accuracy']:>19.3f}")
    trl_marks = [(m["minutes"], m["step"], m["accuracy"]) for m in theirs]
    print("at each 10-minute mark, each side's latest held-out accuracy (at or before it)")
    print("minute      ours    TRL")
    for mark, a, b in ten_minute_marks(ours_marks, trl_marks):
        lead = "ours ahead" if a > b else "even" if a == b else "TRL ahead"
        print(f"{mark:>6}{a:>10.3f}{b:>7.3f}  {lead}")


def ten_minute_marks(
    ours: Sequence[tuple[float, int, float]], theirs: Sequence[tuple[float, int, float]]
) -> list[tuple[int, float, float]]:
    """(minute, ours, theirs) at 10, 20, ... minutes while both sides ran that long: each
    side's latest score at or before the minute (marks are (minutes, step, accuracy))."""
    end = min(ours[-1][0], theirs[-1][0]) if ours and theirs else 0.0
    out = []
    for mark in range(10, int(end) + 1, 10):
        a = [acc for minutes, _, acc in ours if minutes <= mark]
        b = [acc for minutes, _, acc in theirs if minutes <= mark]
        if a and b:
            out.append((mark, a[-1], b[-1]))
    return out


def _row(shape: str, seed: str, vals: Sequence[float], asynchronous: bool) -> str:
    """One printed line: both sides' s/step, their ratio, both held-out accuracies."""
    a_s, b_s, acc_a, acc_b = vals
    cells = (
        shape,
        seed,
        f"{a_s:.3f}",
        f"{b_s:.3f}",
        f"{(b_s / a_s if asynchronous else a_s / b_s):.2f}",
        f"{acc_a:.3f}",
        f"{acc_b:.3f}",
    )
    return "  ".join(f"{c:>10}" for c in cells)


if __name__ == "__main__":
    main()
