"""The evaluate report's files: the JSON document, a Markdown table, a bar chart, the samples.

Input: the report (`{"baseline", "sampling", "results": [a line per checkpoint, the
baseline first]}`, `stages.evaluate.run`) and every sample's row. Output, at `output` (the
stage's `report.json`) and beside it: `report.md` (a table with the differences to the baseline),
`report.png` (a bar chart) and `generations.jsonl`; each written atomically, the JSON last.
"""

from __future__ import annotations

import json
import os
from typing import Any

from stages.lib.io.jsonl import atomic_path, atomic_write, write_jsonl


def write_report(output: str, report: dict[str, Any], samples: list[dict[str, Any]]) -> None:
    """report.json at `output`; report.md, report.png and generations.jsonl beside it."""
    folder = os.path.dirname(output) or "."
    stem = os.path.splitext(output)[0]
    write_jsonl(os.path.join(folder, "generations.jsonl"), samples)
    atomic_write(stem + ".md", render_markdown(report))
    _write_chart(stem + ".png", report)
    atomic_write(output, json.dumps(report, indent=2) + "\n")


def render_markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table, with differences to the baseline."""
    results = report["results"]
    base = results[0]
    ks = list(base["pass_at_k"])
    episodes = "first_turn_accuracy" in base
    scored = "reward_model_score" in base
    head = ["checkpoint", "n", "accuracy", "Δ accuracy", "mean reward", "Δ mean reward"]
    if scored:
        head += ["reward-model score", "Δ reward-model score"]
    head += [f"pass@{k}" for k in ks]
    if episodes:
        head += EPISODE_COLUMNS
    lines = [
        f"# Evaluation: baseline `{report['baseline']}`",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in results:
        cells = [
            f"`{r['checkpoint']}`",
            str(r["n"]),
            f"{r['accuracy']:.3f}",
            f"{100 * (r['accuracy'] - base['accuracy']):+.1f} pts",
            f"{r['mean_reward']:.3f}",
            f"{r['mean_reward'] - base['mean_reward']:+.3f}",
        ]
        if scored:
            score = r["reward_model_score"]
            cells += [f"{score:.3f}", f"{score - base['reward_model_score']:+.3f}"]
        cells += [f"{r['pass_at_k'].get(k, float('nan')):.3f}" for k in ks]
        if episodes:
            cells += [
                f"{r['first_turn_accuracy']:.3f}",
                f"{100 * (r['first_turn_accuracy'] - base['first_turn_accuracy']):+.1f} pts",
                f"{r['mean_turns']:.2f}",
                f"{r['mean_total_reward']:.3f}",
                str(r["failed_episodes"]),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    if episodes:
        lines += ["", "Accuracy: episodes solved within the environment's turns."]
    if scored:
        lines += [
            "",
            "Reward-model score: the reward model's mean score of every answer; a score that "
            "rises while accuracy does not is over-optimisation.",
        ]
    return "\n".join(lines) + "\n"


EPISODE_COLUMNS = [
    "first-turn accuracy",
    "Δ first-turn accuracy",
    "mean turns",
    "mean total reward",
    "failed episodes",
]


def _write_chart(path: str, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    first = ["first_turn_accuracy"] if "first_turn_accuracy" in results[0] else []
    metrics = ["accuracy", *first, *(f"pass@{k}" for k in results[0]["pass_at_k"]), "mean_reward"]
    width = 0.8 / len(results)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(metrics), 3.6))
    lowest = 0.0
    for i, r in enumerate(results):
        values = [r["accuracy"], *(r[f] for f in first), *r["pass_at_k"].values(), r["mean_reward"]]
        lowest = min(lowest, *values)
        xs = [m + (i - (len(results) - 1) / 2) * width for m in range(len(metrics))]
        bars = ax.bar(xs, values, width, label=r["checkpoint"])
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(metrics)), metrics)
    ax.set_ylim(lowest - 0.05 if lowest < 0 else 0, 1.05)  # an environment's penalties go below 0
    ax.set_title(f"evaluation on {results[0]['n']} held-out prompts")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
