"""The collect stage `pipe tune` measures, and the function that measures it at a level.

Input: a pipeline file, the name of one of its collect stages and `--set` overrides.
Output: a `Target` (the loaded pipeline, the stage's config as `pipe run` would run it,
and the first `SAMPLE_ROWS` prompt rows from its `start_idx`), or a located `PipeError`
when the stage is not a collect stage, the pipeline is invalid or the prompts file is not
a local JSONL with rows; and `collector_measure`: `measure(parallelism) -> Level` through
the collector's own client and verifier (`stages.collect.measure.measure_level`), sending
`requests_for` requests at each level.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import PipeError, did_you_mean
from stages.collect.tune.sweep import Level, MeasureFn
from stages.lib.io.jsonl import read_jsonl

if TYPE_CHECKING:
    from engine.load.load import LoadedPipeline
    from stages.collect import CollectConfig

log = logging.getLogger("pipe.tune")
SAMPLE_ROWS = 512
MIN_LEVEL_S = 2.0


def requests_for(parallelism: int, fixed: int | None, last_rate: float = 0.0) -> int:
    """Requests sent at a level: `fixed`, or by default 4 waves, at least 100, and enough
    for `MIN_LEVEL_S` seconds at the previous level's rate (short windows are noisy)."""
    if fixed is not None:
        return fixed
    return max(100, 4 * parallelism, math.ceil(MIN_LEVEL_S * last_rate))


@dataclass(frozen=True)
class Target:
    """The collect stage to measure: its config, prompt rows and where it is in the file."""

    loaded: LoadedPipeline
    stage: str
    cfg: CollectConfig
    rows: list[dict[str, Any]]
    stage_dir: str = ""  # where `pipe run` keeps the stage's files (its last run's usage)


def _collect_config(loaded: LoadedPipeline, stage: str) -> tuple[CollectConfig, str]:
    """The stage's config as `pipe run` would run it: resolved, presets and derived rules
    applied, and the stage's folder (`PipeError` when the stage is not a collect stage or the
    pipeline is invalid)."""
    from engine.resolve.resolve import resolve
    from stages.collect import CollectConfig

    spec = loaded.spec
    if stage not in spec.stages:
        hint = did_you_mean(stage, sorted(spec.stages))
        raise PipeError.single(None, "--stage", f"no stage named '{stage}' in {loaded.path}{hint}")
    kind_name = spec.stages[stage].kind
    if kind_name != "collect":
        collects = [n for n, s in spec.stages.items() if s.kind == "collect"]
        hint = f"; collect stages: {', '.join(repr(n) for n in collects)}" if collects else ""
        where = loaded.doc.value_loc(("stages", stage, "kind"))
        msg = f"pipe tune measures a collect stage, found kind '{kind_name}'{hint}"
        raise PipeError.single(where, f"stages.{stage}.kind", msg)
    resolved = resolve(loaded)
    cfg = resolved.stages[stage].config
    assert isinstance(cfg, CollectConfig)
    from stages.collect.run import prepared  # a GGUF converted, chat_template applied

    return prepared(cfg, resolved.run_dir, log), f"{resolved.run_dir.rstrip('/')}/{stage}"


def _sample_rows(loaded: LoadedPipeline, stage: str, cfg: CollectConfig) -> list[dict[str, Any]]:
    """The first `SAMPLE_ROWS` prompt rows from `start_idx` of the stage's input file."""
    from engine.load.load import stage_config_data
    from engine.stage import get_kind

    path = ("stages", stage, "config", "input")
    where = loaded.doc.value_loc(path)
    dotted = ".".join(path)
    kind = get_kind("collect")
    assert kind is not None
    written = stage_config_data(loaded.spec, stage, kind).get("input")
    if not cfg.input or not written or written.startswith("@") or "://" in cfg.input:
        found = f"'{written}'" if written else "none (it comes from an upstream stage)"
        msg = (
            f"pipe tune needs a local prompts file, found {found}; "
            f"give one with --set {dotted}=PATH"
        )
        raise PipeError.single(where, dotted, msg)
    file = cfg.input
    rel = os.path.relpath(file)
    file = file if rel.startswith("..") else rel  # as the user reads it
    stop = cfg.end_idx if cfg.end_idx is not None else cfg.start_idx + SAMPLE_ROWS
    stop = min(stop, cfg.start_idx + SAMPLE_ROWS)
    try:
        rows = list(itertools.islice(read_jsonl(file), cfg.start_idx, stop))
    except FileNotFoundError:
        raise PipeError.single(where, dotted, f"no such file '{file}'") from None
    except ValueError as exc:
        raise PipeError.single(where, dotted, f"not JSONL: {exc}") from None
    if not rows:
        raise PipeError.single(where, dotted, f"'{file}' holds no prompt rows from start_idx")
    return rows


def load_target(pipeline: str, stage: str, overrides: tuple[str, ...] = ()) -> Target:
    """Load the pipeline and the collect stage's config and prompt sample; `PipeError` if
    unusable."""
    from engine.load.load import load_pipeline

    loaded = load_pipeline(pipeline, overrides)
    cfg, stage_dir = _collect_config(loaded, stage)
    return Target(loaded, stage, cfg, _sample_rows(loaded, stage, cfg), stage_dir)


def collector_measure(target: Target, requests: int | None) -> MeasureFn:
    """`measure(parallelism)` through the collector's real client and verifier."""
    from stages.collect.measure import measure_level

    last_rate = 0.0

    def measure(parallelism: int) -> Level:
        nonlocal last_rate
        n = requests_for(parallelism, requests, last_rate)
        log.info("measuring parallelism %d (%d requests)", parallelism, n)
        try:
            level: Level = measure_level(target.cfg, target.rows, parallelism, n)
        except ValueError as exc:  # a prompt row the collector cannot use
            path = ("stages", target.stage, "config", "input")
            where = target.loaded.doc.value_loc(path)
            raise PipeError.single(where, ".".join(path), str(exc)) from None
        last_rate = level.rollouts_per_s
        return level

    return measure
