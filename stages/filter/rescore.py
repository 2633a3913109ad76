"""Rollouts scored again by the filter's own verifier (`verifier:`, e.g. an LLM judge) before
the rules run.

Input: the rollout JSONL, the verifier block and the run folder (a judge's answers are cached
there: `stages.lib.judge`). Output: a copy of the file in the stage's temporary folder, every
one-turn row's `reward` the verifier's (the collected one kept as `collected_reward`), a row
the verifier could not score left out; and the counts for the report: rows `rescored`,
`unscored` (left out: a judge's reply without a score is a counted failure, not a zero
reward) and a judge's requests and cache hits. Rows are scored in chunks, a judge's chunk
asked at once. An episode row (collect with an environment) is refused: its reward is the
sum over its turns, which one verifier call does not give.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from stages.filter.rows import FilterInputError
from stages.lib.verify import make_verifier

if TYPE_CHECKING:
    from stages.lib.config import Verifier

CHUNK = 512  # rows a judge is asked about at once


def rescore(verifier: Verifier, run_dir: str, src: str, tmp: str) -> tuple[str, dict[str, Any]]:
    """The rescored copy of `src` (in `tmp`) and the counts."""
    score = make_verifier(verifier, run_dir)
    many = getattr(score, "score_many", None)
    dst = os.path.join(tmp, "rescored.jsonl")
    counts: dict[str, Any] = {"rescored": 0, "unscored": 0}
    try:
        with open(dst, "w", encoding="utf-8") as out:
            for chunk in _chunks(src):
                pairs = [(row, str(row.get("completion", ""))) for row in chunk]
                scored = many(pairs) if many is not None else [_one(score, p) for p in pairs]
                for row, reward in zip(chunk, scored, strict=True):
                    if isinstance(reward, Exception):
                        counts["unscored"] += 1
                        continue
                    row["collected_reward"], row["reward"] = row.get("reward"), float(reward)
                    out.write(json.dumps(row, ensure_ascii=False) + "\n")
                    counts["rescored"] += 1
    finally:
        if hasattr(score, "close"):
            score.close()
    counts.update(getattr(score, "counts", dict)())
    return dst, counts


def _one(score: Any, pair: tuple[dict[str, Any], str]) -> float | Exception:
    try:
        return float(score(*pair))
    except ValueError as exc:
        return exc


def _chunks(src: str) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    with open(src, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or "turns" in row:
                raise FilterInputError(
                    f"{src}:{n}: the filter's verifier re-scores one-turn rollouts; this row is "
                    "an episode (collect with an environment): score it there"
                )
            chunk.append(row)
            if len(chunk) == CHUNK:
                yield chunk
                chunk = []
    if chunk:
        yield chunk
