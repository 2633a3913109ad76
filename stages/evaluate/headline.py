"""The evaluate stage's headline: its report -> an accuracy table for the terminal.

Input: the stage's result (`report.json`'s `results` and `accuracy_delta`). Output: a
header and a row per checkpoint (n, accuracy, pass@k, mean reward, the reward model's mean
score when one scored, delta to the baseline), aligned, for `pipe run` to print last.

One name, two sides of one concept (a run's headline printed by `pipe run`: the engine's side,
which prints what a kind's headline hook returns; this file: evaluate's hook, its report as an
accuracy table; `engine/run/headline.py` the other side).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def table(result: Mapping[str, Any]) -> list[str]:
    results = result.get("results") or []
    if not results:
        return []
    baseline = result.get("baseline")
    deltas = result.get("accuracy_delta") or {}
    ks = list(results[0].get("pass_at_k") or {})
    rm = ["rm_score"] if "reward_model_score" in results[0] else []
    header = ["checkpoint", "n", "accuracy", *(f"pass@{k}" for k in ks), "mean_reward", *rm]
    header.append("delta")
    rows = [header]
    for r in results:
        name = r["checkpoint"]
        delta = deltas.get(name)
        shown = (
            "baseline"
            if name == baseline
            else (f"{delta * 100:+.1f} pts" if delta is not None else "")
        )
        rows.append(
            [
                str(name),
                str(r.get("n", "")),
                f"{r.get('accuracy', 0.0):.1%}",
                *(f"{(r.get('pass_at_k') or {}).get(k, 0.0):.1%}" for k in ks),
                f"{r.get('mean_reward', 0.0):.3f}",
                *(f"{r.get('reward_model_score', 0.0):.3f}" for _ in rm),
                shown,
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
