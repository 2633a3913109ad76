"""Verifiers: turn a (row, completion) pair into a reward in [0, 1].

Input: a `stages.lib.config.Verifier` config. Output: a callable
`score(row, completion) -> float` used by collect and evaluate.

Every kind first extracts the answer from the completion: the text inside the
last `<answer>...</answer>` pair when there is one, else the stripped
completion. Kinds:

- `reasoning_gym`: the task's own scorer, found through
  `reasoning_gym.get_score_answer_fn(row["metadata"]["source_dataset"])`
  (falling back to `row["task"]`), looked up once per task and cached.
- `exact_match`: the answer equals `str(row[answer_field])` once whitespace
  runs are collapsed to one space.
- `regex`: the pattern is searched in the whole completion; `{answer}` in the
  pattern stands for the escaped reference answer.
- `math`: math-verify's `parse` and `verify` (its signal-based timeouts are
  used only on the main thread, where signals work).
- `judge`: an LLM grades the answer (`stages.lib.judge`): its scores cached in the run
  folder (`run_dir`; in memory without one), an answer holding no score an `Unjudged` error.
- `module:function`: a user callable `fn(row, completion) -> float | bool`;
  a result outside [0, 1] is an error, not clamped.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable
from typing import Any

from stages.lib.config import Verifier

Score = Callable[[dict[str, Any], str], float]

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(completion: str) -> str:
    """The text of the last `<answer>...</answer>` pair, else the stripped completion."""
    if "<answer>" in completion:
        found = _ANSWER.findall(completion)
        if found:
            return str(found[-1]).strip()
    return completion.strip()


def normalise(text: str) -> str:
    """Collapse whitespace runs to one space and strip the ends."""
    return " ".join(text.split())


def make_verifier(cfg: Verifier, run_dir: str | None = None) -> Score:
    """The scoring function for `cfg.kind`; raises ValueError on an unusable config. A judge's
    cache lives in `run_dir`."""
    if cfg.kind == "judge":
        from stages.lib.judge.grader import Judge

        return Judge(cfg, run_dir)
    if cfg.kind == "reasoning_gym":
        return _reasoning_gym(cfg.answer_field)
    if cfg.kind == "exact_match":
        return _exact_match(cfg.answer_field)
    if cfg.kind == "regex":
        if not cfg.pattern:
            raise ValueError("verifier kind 'regex' needs a 'pattern'")
        return _regex(cfg.pattern, cfg.answer_field)
    if cfg.kind == "math":
        return _math(cfg.answer_field)
    return _user_callable(cfg.kind)


def _reference(row: dict[str, Any], field: str) -> str:
    if field not in row:
        raise ValueError(f"the row has no field '{field}' holding the reference answer")
    return str(row[field])


def _exact_match(field: str) -> Score:
    def score(row: dict[str, Any], completion: str) -> float:
        answer = normalise(extract_answer(completion))
        return 1.0 if answer == normalise(_reference(row, field)) else 0.0

    return score


def _regex(pattern: str, field: str) -> Score:
    plain = re.compile(pattern) if "{answer}" not in pattern else None

    def score(row: dict[str, Any], completion: str) -> float:
        if plain is not None:
            return 1.0 if plain.search(completion) else 0.0
        compiled = re.compile(pattern.replace("{answer}", re.escape(_reference(row, field))))
        return 1.0 if compiled.search(completion) else 0.0

    return score


def _reasoning_gym(field: str) -> Score:
    scorers: dict[str, Callable[..., Any]] = {}

    def scorer_for(task: str) -> Callable[..., Any]:
        fn = scorers.get(task)
        if fn is None:
            import reasoning_gym

            fn = reasoning_gym.get_score_answer_fn(task)
            scorers[task] = fn
        return fn

    def score(row: dict[str, Any], completion: str) -> float:
        metadata = row.get("metadata")
        if not isinstance(metadata, dict):
            metadata = {}
        task = metadata.get("source_dataset") or row.get("task")
        if not isinstance(task, str):
            raise ValueError(
                "the row names no reasoning-gym task (metadata.source_dataset or task)"
            )
        question = row.get("prompt") if isinstance(row.get("prompt"), str) else row.get("question")
        entry = {"question": question, "answer": _reference(row, field), "metadata": metadata}
        return _checked(scorer_for(task)(extract_answer(completion), entry))

    return score


def _math(field: str) -> Score:
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)

    def timeouts() -> int | None:
        return 5 if threading.current_thread() is threading.main_thread() else None

    def score(row: dict[str, Any], completion: str) -> float:
        limit = timeouts()
        gold_text = _reference(row, field)
        if "$" not in gold_text and "\\boxed" not in gold_text:
            gold_text = f"${gold_text}$"
        gold = parse(gold_text, parsing_timeout=limit)
        answer = extract_answer(completion)
        pred = parse(answer, parsing_timeout=limit) or parse(f"${answer}$", parsing_timeout=limit)
        if not gold or not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=limit) else 0.0

    return score


def _user_callable(spec: str) -> Score:
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"verifier '{spec}': cannot load it ({exc})") from exc
    if not callable(fn):
        raise ValueError(f"verifier '{spec}' is not callable")

    def score(row: dict[str, Any], completion: str) -> float:
        return _checked(fn(row, completion))

    return score


def _checked(value: Any) -> float:
    reward = float(value)
    if not 0.0 <= reward <= 1.0:
        raise ValueError(f"the verifier returned {reward}, outside [0, 1]")
    return reward
