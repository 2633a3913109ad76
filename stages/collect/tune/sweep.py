"""The parallelism sweep and the bottleneck test, as pure functions of a measuring function.

Input: `measure(parallelism) -> Level` (in `pipe tune`, the collector's
`measure_level` on a sample of prompts; in tests, a model of a server).
Output: a `Sweep` (the levels measured, the knee, the recommendation, why it
stopped) or a `Diagnosis`.

The method is NeMo Gym's manual one, automated: start low, double the
parallelism until throughput rises by less than `MIN_GAIN` (10%) or errors
and timeouts appear, at most `max_levels` levels. The knee is the lowest
error-free level whose throughput is within `MIN_GAIN` of the best error-free
level: past it, more requests in flight only queue. The recommendation is 80%
of the knee, rounded half up, for headroom.

The bottleneck test sends the same requests at parallelism 5 and 20: ~4x the
throughput means parallelism is the limit; no gain with rising latency means
the backend is; no gain with the verifier taking most of the wall time means
verification is. `gpu_advice` adds the GPU side: a stage whose GPUs were busy less than
the OpenRLHF guide's 80% in its last `pipe run` gets the guide's fixes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("pipe.tune")

MIN_GAIN = 0.10
HEADROOM = 0.8
DIAGNOSE_LEVELS = (5, 20)


class Level(Protocol):
    """One measured parallelism level (`stages.collect.measure.LevelResult` is one)."""

    @property
    def parallelism(self) -> int: ...
    @property
    def rollouts_per_s(self) -> float: ...
    @property
    def p50_s(self) -> float: ...
    @property
    def p95_s(self) -> float: ...
    @property
    def errors(self) -> int: ...  # failed requests, timeouts included
    @property
    def timeouts(self) -> int: ...
    @property
    def verify_s(self) -> float: ...
    @property
    def wall_s(self) -> float: ...


MeasureFn = Callable[[int], Level]


@dataclass(frozen=True)
class Sweep:
    """What a sweep found; `knee` and `recommended` are None when every level had errors."""

    levels: tuple[Level, ...]
    knee: int | None
    recommended: int | None
    stopped: str


def gain(before: Level, after: Level) -> float:
    """Relative throughput change from `before` to `after` (inf from zero to something)."""
    if before.rollouts_per_s <= 0:
        return math.inf if after.rollouts_per_s > 0 else 0.0
    return after.rollouts_per_s / before.rollouts_per_s - 1.0


def find_knee(levels: tuple[Level, ...] | list[Level], within: float = MIN_GAIN) -> int | None:
    """The lowest error-free parallelism within `within` of the best error-free throughput."""
    clean = [lv for lv in levels if not lv.errors]
    if not clean:
        return None
    peak = max(lv.rollouts_per_s for lv in clean)
    return min(lv.parallelism for lv in clean if lv.rollouts_per_s >= (1.0 - within) * peak)


def recommend(knee: int) -> int:
    """80% of the knee, rounded half up, at least 1."""
    return max(1, math.floor(HEADROOM * knee + 0.5))


def sweep(
    measure: MeasureFn, *, start: int = 8, max_levels: int = 8, min_gain: float = MIN_GAIN
) -> Sweep:
    """Double the parallelism from `start` until the gain is under `min_gain` or errors appear."""
    if start < 1 or max_levels < 1:
        raise ValueError("sweep needs start >= 1 and max_levels >= 1")
    levels: list[Level] = []
    stopped = f"reached {max_levels} levels while throughput still rose; try a higher --max-levels"
    parallelism = start
    for _ in range(max_levels):
        level = measure(parallelism)
        levels.append(level)
        log.info(
            "parallelism %d: %.1f rollouts/s, p50 %.3f s, p95 %.3f s, %d errors",
            level.parallelism,
            level.rollouts_per_s,
            level.p50_s,
            level.p95_s,
            level.errors,
        )
        if level.errors:
            stopped = f"{level.errors} errors or timeouts at parallelism {parallelism}"
            break
        if len(levels) > 1 and gain(levels[-2], level) < min_gain:
            change = gain(levels[-2], level)
            stopped = (
                f"throughput changed {change:+.0%} from parallelism {parallelism // 2} to"
                f" {parallelism} (less than +{min_gain:.0%})"
            )
            break
        parallelism *= 2
    knee = find_knee(levels, min_gain)
    return Sweep(tuple(levels), knee, recommend(knee) if knee is not None else None, stopped)


@dataclass(frozen=True)
class Diagnosis:
    """The bottleneck test's verdict (what limits throughput), why, and what to do next."""

    verdict: str
    reason: str
    next_step: str


def diagnose(low: Level, high: Level) -> Diagnosis:
    """Compare two levels (5 and 20 in flight) and say what limits throughput."""
    ideal = high.parallelism / low.parallelism
    if low.errors:
        return Diagnosis(
            "backend",
            f"{low.errors} of the requests failed even at parallelism {low.parallelism}",
            "check the backend (its URL, model name, API key and health) before tuning",
        )
    if high.errors:
        return Diagnosis(
            "backend",
            f"{high.errors} errors or timeouts at parallelism {high.parallelism}, none at "
            f"{low.parallelism}: the backend is overloaded",
            f"keep num_samples_in_parallel below {high.parallelism} (`pipe tune --start "
            f"{low.parallelism}` finds the knee), or scale the backend",
        )
    ratio = high.rollouts_per_s / low.rollouts_per_s if low.rollouts_per_s > 0 else math.inf
    scaled = (
        f"throughput scaled {ratio:.1f}x from parallelism {low.parallelism} to "
        f"{high.parallelism} (ideal {ideal:.0f}x)"
    )
    if ratio >= ideal / 2:
        return Diagnosis(
            "parallelism",
            scaled,
            "raise num_samples_in_parallel: run `pipe tune` to find the knee, "
            "with --write to keep it",
        )
    verify_share = high.verify_s / high.wall_s if high.wall_s > 0 else 0.0
    if verify_share >= 0.5:
        return Diagnosis(
            "verification",
            f"{scaled}, and the verifier took {verify_share:.0%} of the wall time",
            "make the verifier cheaper: it runs once per rollout, in the collector's process",
        )
    latency = high.p50_s / low.p50_s if low.p50_s > 0 else math.inf
    if latency >= 1.5:
        return Diagnosis(
            "backend",
            f"{scaled} while p50 latency rose {latency:.1f}x: requests queue in the backend",
            "scale the backend (more replicas or engines, more GPUs, larger batches); "
            "more parallelism will not help",
        )
    return Diagnosis(
        "client",
        f"{scaled} while p50 latency stayed flat ({latency:.1f}x): "
        "requests are not really concurrent",
        "check the collector's CPU and connection limits, "
        "or shard the collection across Dask workers",
    )


GPU_TARGET = 80.0  # the OpenRLHF tuning guide: "GPU utilization: should be >80%"
# the guide's "Low GPU Utilization" fixes, as pipe's settings spell them
GPU_FIXES = (
    "increase batch sizes (micro_rollout_batch_size, micro_train_batch_size, "
    "num_samples_in_parallel)",
    "enable the hybrid engine (profile: high-performance colocates all models)",
    "reduce vLLM's tensor parallel size (vllm_tensor_parallel_size: more engines instead)",
)


def gpu_advice(usage: Mapping[str, Any]) -> list[str]:
    """`GPU utilisation N% < 80%` and the guide's fixes when a stage's GPUs were busy less
    than the guide's target on average (`usage`: the summary `pipe run` keeps in the stage's
    `metrics.json`); nothing without GPU figures or at the target."""
    mean = usage.get("gpu_util_mean")
    if not isinstance(mean, int | float) or mean >= GPU_TARGET:
        return []
    head = f"GPU utilisation {mean:.0f}% < {GPU_TARGET:.0f}% (the tuning guide's target)"
    return [head, *(f"  - {fix}" for fix in GPU_FIXES)]
