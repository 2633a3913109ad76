"""The run's result where the user looks: what each stage used, each stage's headline, then
the tracker links.

Input: a `RunReport` (and each stage's `metrics.json`, so a cached stage shows what it
found when it ran). Output: the lines `pipe run` prints on stdout at the end: first one
line per stage with what it used (`engine.run.usage`: CPU and RSS, GPUs' utilisation and
memory, mean and peak), then what each found: each kind says what matters through its
config's `headline` hook (evaluate: the accuracy table; train: the final loss; ...), the
engine only lays them out, so the last stage's result (evaluate's table) ends the output.

One name, two sides of one concept (a run's headline printed by `pipe run`: the engine's side,
which prints what a kind's headline hook returns; `stages/evaluate/headline.py`: evaluate's
hook, its report as an accuracy table).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from engine.run.report import RunReport
from engine.run.usage_summary import usage_line
from engine.stage import kinds

log = logging.getLogger("pipe.run")


def _result(record: Any) -> dict[str, Any]:
    if record.metrics:
        return dict(record.metrics)
    try:
        with open(f"{record.stage_dir}/metrics.json", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def headlines(report: RunReport) -> list[str]:
    """What each stage used, one line per stage that has something to say (more for a
    table), then the links."""
    lines: list[str] = []
    used: list[str] = []
    for name, rec in report.stages.items():
        if rec.status not in ("succeeded", "cached"):
            continue
        kind = kinds().get(rec.kind)
        result = _result(rec)
        usage = result.get("usage")
        if isinstance(usage, dict) and "cpu_util_mean" in usage:
            used.append(f"{name} used: {usage_line(usage)}")
        try:
            said = kind.config.headline(result) if kind is not None else []
        except Exception as exc:  # a kind's bug must not hide the run's result
            log.debug("%s: headline failed: %s", name, exc, exc_info=True)
            continue
        cached = " (cached)" if rec.status == "cached" else ""
        if len(said) == 1:
            lines.append(f"{name}{cached}: {said[0]}")
        elif said:
            lines.append(f"{name}{cached}:")
            lines.extend(f"  {line}" for line in said)
    lines = [*used, *lines]  # what each stage used, then what each found
    for tracker, where in report.tracking.items():
        lines.append(f"{tracker}: {where}")
    return lines
