"""Benchmark: GRPO in bf16 beside fp32 on CPU, same seed, at ZeRO-0 on one rank and at
ZeRO-3 over two gloo ranks (the local engine, weights over gloo, the probe after every sync).

    .venv/bin/python bench/rl_bf16.py [--steps 20] [--last 5]

Each of the four runs is `pipe run` of one rl stage from a tiny model built from config
(chain_sum prompts, reward 1 when the answer holds a digit: a task a random model learns in
a few steps). A run fails if any probe fails (the step raises). Printed side by side in one
run: per case, the reward mean of the first and of the last `--last` steps in fp32 and in
bf16, the difference of the last ones
difference (the acceptance bound is 0.1), the largest probe difference of each, and the
seconds per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "rl_bf16"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

PIPELINE = """\
    name: bf16
    cluster: {{scheduler: local, workers: 1, gpus: 0}}
    defaults: {{seed: 0}}
    stages:
      data:
        kind: dataset
        config: {{task: chain_sum, size: 512, test_size: 32}}
      rl:
        kind: rl
        needs: [data]
        config:
          input: "@data"
          model: {{hidden_size: 64, num_layers: 2, num_heads: 4, vocab_size: 300}}
          verifier: {{kind: regex, pattern: "[0-9]"}}
          bf16: {bf16}
          zero_stage: {zero}
          num_processes: {ranks}
          num_repeats: 4
          rollout_batch_size: 8
          train_batch_size: 32
          micro_train_batch_size: 8
          learning_rate: 0.003
          max_steps: {steps}
          max_output_tokens: 4
          eval_every: 1000
          num_threads: 1
"""

CASES = [("ZeRO-0, 1 rank", 0, 1), ("ZeRO-3, 2 gloo ranks", 3, 2)]


def run(name: str, bf16: bool, zero: int, ranks: int, steps: int) -> dict[str, Any]:
    """One `pipe run`; its metrics rows, settings and seconds."""
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    text = PIPELINE.format(bf16=str(bf16).lower(), zero=zero, ranks=ranks, steps=steps)
    (folder / "p.yaml").write_text(textwrap.dedent(text))
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", "run", "p.yaml", "--force"],
        cwd=folder,
        env=ENV,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    stage = folder / "runs/bf16/rl"
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    settings = json.loads((stage / "settings.json").read_text())
    return {"rows": rows, "settings": settings, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--last", type=int, default=5)
    args = parser.parse_args()
    print(
        f"{'case':<22} {'precision':<9} {'reward first':>12} {'reward last':>11} "
        f"{'probe max':>10} {'s/step':>7}"
    )
    table = []
    for label, zero, ranks in CASES:
        means = {}
        for bf16 in (False, True):
            name = f"z{zero}-r{ranks}-{'bf16' if bf16 else 'fp32'}"
            out = run(name, bf16, zero, ranks, args.steps)
            rows = out["rows"]
            assert [r["step"] for r in rows] == list(range(1, args.steps + 1)), name
            last = rows[-args.last :]
            means[bf16] = sum(r["reward_mean"] for r in last) / len(last)
            first = sum(r["reward_mean"] for r in rows[: args.last]) / args.last
            probe = max(r["probe_diff"] for r in rows)
            precision = "bf16" if bf16 else "fp32"
            print(
                f"{label:<22} {precision:<9} {first:>12.3f} {means[bf16]:>11.3f} {probe:>10.2g} "
                f"{out['seconds'] / args.steps:>7.2f}",
                flush=True,
            )
            print(f"{'':<22} sync: {out['settings']['vllm_sync_backend']['how']}", flush=True)
        diff = means[True] - means[False]
        table.append((label, diff))
        print(f"{label:<22} bf16 - fp32 reward (last {args.last}): {diff:+.3f}", flush=True)
    worst = max(abs(d) for _, d in table)
    print(f"largest |bf16 - fp32|: {worst:.3f} (bound 0.1): {'ok' if worst <= 0.1 else 'OVER'}")


if __name__ == "__main__":
    main()
