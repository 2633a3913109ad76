"""Sharding a collect across Dask workers, merged in input order.

Input: a CollectConfig with `shards` N > 1, run inside a Dask worker. Output:
the same `cfg.output` (and failures sidecar) a single run would write.

The [start, end) prompt range is split into N contiguous shards; shard K is
a Dask task (submitted through `distributed.worker_client`, so the stage's
own task yields its thread while it waits) that runs the collector on its
range with its own concurrency, writing `<output>.shard-K.partial` and, once
complete, `<output>.shard-K`. Each shard resumes on its own. When all are
done their outputs (each sorted) are concatenated in shard order into
`<output>` with os.replace, failures first, then the shard files removed.
"""

from __future__ import annotations

import itertools
import json
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

from stages.collect import io, publish
from stages.collect.inputs import row_range
from stages.collect.stats import LatencyHistogram
from stages.lib.io.jsonl import count_lines

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.collect import CollectConfig

_SUMMED = ("written", "failed", "skipped_resumed", "skipped_failed", "retries", "verify_errors")


SHARD_TIMEOUT_S = 24 * 3600.0  # the first task waits this long for another's shard


def split_range(start: int, end: int, shards: int) -> list[tuple[int, int]]:
    """[start, end) cut into at most `shards` contiguous, non-empty, near-equal pieces."""
    total = max(0, end - start)
    shards = max(1, min(shards, total))
    bounds = [start + total * k // shards for k in range(shards + 1)]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


def shard_output(output: str, k: int) -> str:
    return f"{output}.shard-{k}"


def run_shard(cfg: CollectConfig, ctx: StageContext) -> dict[str, Any]:
    """One shard's collect (a Dask task): its range into its own output."""
    from stages.collect.ranged import collect_range, up_to_date

    if os.path.exists(cfg.output):
        return up_to_date(cfg.output, ctx)
    return collect_range(cfg, ctx, with_histogram=True)


def shard_configs(cfg: CollectConfig, shards: int) -> list[CollectConfig]:
    """The config of each shard: a contiguous piece of the range, its own output file."""
    assert cfg.input is not None
    start, end = row_range(cfg.start_idx, cfg.end_idx, cfg.limit)
    if end is None:
        end = max(start, count_lines(cfg.input))
    else:
        end = min(end, max(start, count_lines(cfg.input)))
    ranges = split_range(start, end, shards) or [(start, start + 1)]
    return [
        cfg.model_copy(
            update={
                "start_idx": a,
                "end_idx": b,
                "limit": None,
                "shards": 1,
                "output": shard_output(cfg.output, k),
            }
        )
        for k, (a, b) in enumerate(ranges)
    ]


def run_on_nodes(cfg: CollectConfig, ctx: StageContext) -> dict[str, Any]:
    """A collect placed on several workers (one task each): task k collects shard k with the
    engines on its own devices; the first task merges every shard in order."""
    assert ctx.link is not None
    configs = shard_configs(cfg, len(ctx.tasks))
    k = ctx.node_rank
    began = time.perf_counter()
    result = run_shard(configs[k], ctx) if k < len(configs) else {"rows": 0, "written": 0}
    if k > 0:
        ctx.link.publish(f"shard-{k}", json.dumps(result, default=str))
        return result
    results = [result]
    for j in range(1, len(ctx.tasks)):
        results.append(json.loads(ctx.link.lookup(f"shard-{j}", timeout_s=SHARD_TIMEOUT_S)))
    merge_shards(cfg.output, [c.output for c in configs])
    metrics = _merged_metrics(results[: len(configs)], time.perf_counter() - began, cfg.output)
    metrics["workers"] = len(ctx.tasks)
    return metrics


def run_sharded(cfg: CollectConfig, ctx: StageContext, shards: int) -> dict[str, Any]:
    """Split the range into shard tasks, wait for them, merge their outputs in order."""
    configs = shard_configs(cfg, shards)
    ctx.log.info(
        "collect: %d shards over prompts [%d, %d)",
        len(configs),
        configs[0].start_idx,
        configs[-1].end_idx or configs[-1].start_idx,
    )
    began = time.perf_counter()
    from distributed import worker_client

    token = uuid.uuid4().hex[:8]
    with worker_client() as client:
        keys = [f"{ctx.name}-collect-shard-{k}-{token}" for k in range(len(configs))]
        futures = [
            client.submit(run_shard, c, ctx, key=key, pure=False)
            for c, key in zip(configs, keys, strict=True)
        ]
        results = client.gather(futures)
    merge_shards(cfg.output, [c.output for c in configs])
    return _merged_metrics(results, time.perf_counter() - began, cfg.output)


def merge_shards(output: str, parts: list[str]) -> None:
    """Failures, then rollouts, of every shard concatenated in order; shard files removed."""
    failure_parts = [io.failures_path(p) for p in parts]
    if any(os.path.exists(p) for p in failure_parts):
        publish.concat(failure_parts, io.failures_path(output))
    publish.concat(parts, output)
    for path in parts + failure_parts + [io.done_path(p) for p in parts]:
        if os.path.exists(path):
            os.remove(path)


def _merged_metrics(results: list[dict[str, Any]], wall: float, output: str) -> dict[str, Any]:
    hist = LatencyHistogram()
    merged: dict[str, Any] = {key: 0 for key in _SUMMED}
    errors: dict[str, int] = {}
    tokens = {"prompt": 0, "completion": 0}
    for result in results:
        for key in _SUMMED:
            merged[key] += int(result.get(key, 0))
        for kind, n in result.get("errors", {}).items():
            errors[kind] = errors.get(kind, 0) + int(n)
        for kind in tokens:
            tokens[kind] += int(result.get("tokens", {}).get(kind, 0))
        if "latency_histogram" in result:
            hist.merge(LatencyHistogram.from_json(result["latency_histogram"]))
    with open(output, "rb") as handle:
        rows = sum(1 for _ in handle)
    merged.update(
        shards=len(results),
        rows=rows,
        failures=count_lines(io.failures_path(output)),
        wall_s=round(wall, 3),
        rollouts_per_s=round(merged["written"] / wall, 3) if wall > 0 else 0.0,
        tokens_per_s=round(tokens["completion"] / wall, 1) if wall > 0 else 0.0,
        tokens=tokens,
        errors=dict(sorted(errors.items())),
        latency_s={
            q: round(hist.quantile(v), 4) for q, v in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
        },
        concurrency=[r.get("concurrency") for r in results],
    )
    return merged
