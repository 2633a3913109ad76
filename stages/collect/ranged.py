"""Collect one range of prompts into one output: resume what a killed run left, collect the
rest (in-process `local` generation, an HTTP backend, or another ecosystem's agent playing
against the backend: `stages.collect.agent_runs`), publish atomically.

Input: a resolved CollectConfig (its `start_idx`/`end_idx` give the range) and the
StageContext. Output: `cfg.output` and its failures sidecar (`stages.collect.io`),
and the metrics dict. `stages.collect.run` calls it for the whole range, each
shard task of `stages.collect.shard` for its piece.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from stages.collect import io, publish
from stages.collect.collector import run_async
from stages.collect.inputs import Prompt, iter_lines, parse_row, row_range
from stages.collect.stats import Stats
from stages.lib.io.jsonl import count_lines
from stages.lib.verify import make_verifier

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.collect import CollectConfig
    from stages.collect.collector import Recorder
    from stages.lib.backends.endpoint import Endpoint
    from stages.lib.env.message_play import MakeEnv


def up_to_date(output: str, ctx: StageContext) -> dict[str, Any]:
    """Metrics of an output that is already complete."""
    rows = count_lines(output)
    failures = count_lines(io.failures_path(output))
    ctx.log.info("collect: %s is complete (%d rollouts); nothing to do", output, rows)
    leftovers = glob.glob(f"{glob.escape(output)}.shard-*")  # a merge cut short after os.replace
    for path in [io.partial_path(output), io.meta_path(output), *leftovers]:
        if os.path.exists(path):
            os.remove(path)
    return {"up_to_date": True, "rows": rows, "failures": failures, "written": 0}


def collect_range(
    cfg: CollectConfig, ctx: StageContext, *, with_histogram: bool = False
) -> dict[str, Any]:
    """Collect cfg's [start, end) range into cfg.output, resuming what a previous run left.

    `with_histogram` adds the latency histogram (for merging shards' metrics).
    """
    if not cfg.input:
        raise ValueError("collect: 'input' is empty and no upstream stage provides one")
    if "://" not in cfg.input and not os.path.exists(cfg.input):
        raise FileNotFoundError(f"collect: input '{cfg.input}' does not exist")
    score = make_verifier(cfg.verifier, ctx.run_dir)
    start, end = row_range(cfg.start_idx, cfg.end_idx, cfg.limit)
    os.makedirs(os.path.dirname(os.path.abspath(cfg.output)), exist_ok=True)
    done = io.DoneSet(start, cfg.num_repeats, end)
    stats = Stats()
    resumed, failed_runs = _resume(cfg, done, stats, ctx)
    if end is not None:
        stats.total = max(0, (end - start) * cfg.num_repeats - done.count)
    sink = io.Sink(cfg.output)
    from stages.collect.collector import Recorder
    from stages.lib.io.metrics import Metrics

    recorder = Recorder(score, sink, stats, failed_runs, ctx.log, Metrics(ctx.stage_dir))
    try:
        work = pending(cfg.input, start, end, cfg.num_repeats, done)
        if cfg.environment is not None and cfg.environment.agent_plays:
            from stages.collect.agent_runs import collect_agent

            collect_agent(cfg, ctx, pairs(work), recorder)  # another ecosystem's agent plays
        elif cfg.backend.in_process() is not None:
            from stages.collect.in_process import collect_in_process
            from stages.lib.devices import torch_device

            collect_in_process(cfg, work, recorder, torch_device(ctx))
        else:
            _collect_http(cfg, ctx, work, recorder)
    finally:
        sink.close()
        if hasattr(score, "close"):  # a served judge's connections
            score.close()
    # a partial file from an earlier run may hold pairs outside this run's range
    keep = _keep(start, end, cfg.num_repeats) if resumed else None
    rows, failures = publish.finalize(cfg.output, keep)
    metrics = stats.metrics()
    metrics.update(rows=rows, failures=failures)
    counts = getattr(score, "counts", None)
    if counts is not None:  # a judge's requests, cache hits and unscored answers
        metrics.update(counts())
    if with_histogram:
        metrics["latency_histogram"] = stats.latency.to_json()
    return metrics


def _keep(start: int, end: int | None, repeats: int) -> Callable[[int, int], bool]:
    def keep(prompt_idx: int, sample_idx: int) -> bool:
        in_range = start <= prompt_idx and (end is None or prompt_idx < end)
        return in_range and 0 <= sample_idx < repeats

    return keep


def _resume(
    cfg: CollectConfig, done: io.DoneSet, stats: Stats, ctx: StageContext
) -> tuple[bool, dict[io.Key, int]]:
    """Mark pairs written or given up; returns (resuming?, failed-run counts to retry)."""
    if not io.prepare(cfg.output, io.resume_key(cfg)):
        return False, {}
    stats.skipped_resumed = io.scan_partial(io.partial_path(cfg.output), done)
    retry: dict[io.Key, int] = {}
    for key, record in io.read_failures(io.failures_path(cfg.output)).items():
        if done.has(*key):
            continue
        runs = int(record.get("failed_runs", 1))
        if record.get("retryable", True) and runs < cfg.max_failed_runs:
            retry[key] = runs
        elif done.add(*key):
            stats.skipped_failed += 1
    ctx.log.info(
        "collect: resuming %s: %d rollouts already written, %d failed rows to retry, %d given up",
        cfg.output,
        stats.skipped_resumed,
        len(retry),
        stats.skipped_failed,
    )
    return True, retry


def pending(
    path: str, start: int, end: int | None, repeats: int, done: io.DoneSet
) -> Iterator[tuple[Prompt, list[int]]]:
    """(prompt, sample indices still to do) for each row of the range, read lazily."""
    for idx, line in iter_lines(path, start, end):
        if done.count and done.all_done(idx):
            continue
        samples = [s for s in range(repeats) if not done.has(idx, s)] if done.count else None
        yield parse_row(idx, line), samples if samples is not None else list(range(repeats))


def pairs(work: Iterator[tuple[Prompt, list[int]]]) -> Iterator[tuple[Prompt, int]]:
    for prompt, samples in work:
        for sample_idx in samples:
            yield prompt, sample_idx


def _collect_http(
    cfg: CollectConfig,
    ctx: StageContext,
    work: Iterator[tuple[Prompt, list[int]]],
    recorder: Recorder,
) -> None:
    from stages.lib.env.contract import environments

    if cfg.environment is None:
        _collect_endpoint(cfg, ctx, work, recorder, None)
        return
    # an environment that cannot be loaded fails the stage before any engine starts; one
    # served by a process is stopped with the stage
    with environments(cfg.environment, cfg.verifier, ctx.run_dir) as make_env:
        _collect_endpoint(cfg, ctx, work, recorder, make_env)


def _collect_endpoint(
    cfg: CollectConfig,
    ctx: StageContext,
    work: Iterator[tuple[Prompt, list[int]]],
    recorder: Recorder,
    make_env: MakeEnv | None,
) -> None:
    from stages.lib.backends.endpoint import Serving

    log_file = ctx.path(f"{os.path.basename(cfg.output)}.{cfg.backend.kind}.log")  # its servers'
    visible = ctx.device_env().get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else None
    parser = cfg.environment.tool_call_parser if cfg.environment else None
    serving = Serving(ctx.log, ctx.gpus, devices, log_file, parser)
    with cfg.backend.open_endpoint(serving) as endpoint:
        run_async(_collect_async(cfg, endpoint, pairs(work), recorder, make_env))
    if cfg.num_samples_in_parallel == "auto":
        conc = recorder.stats.metrics()["concurrency"]
        ctx.log.info(
            "collect: auto concurrency ended at limit %d (max %d, mean %.1f)",
            conc["final"],
            conc["max"],
            conc["mean"],
        )


async def _collect_async(
    cfg: CollectConfig,
    endpoint: Endpoint,
    work: Iterator[tuple[Prompt, int]],
    recorder: Recorder,
    make_env: MakeEnv | None,
) -> None:
    """Every pair through the collector: one request each, or with `make_env` one episode
    each (`stages.collect.multiturn`)."""
    from stages.collect.collector import Collector
    from stages.collect.multiturn import EpisodeCollector
    from stages.lib.api.adaptive import AdaptiveLimit
    from stages.lib.backends.endpoint import make_client

    parallel = cfg.num_samples_in_parallel
    concurrency: int | AdaptiveLimit = AdaptiveLimit() if parallel == "auto" else parallel
    client = make_client(cfg, endpoint, connections=0 if parallel == "auto" else parallel)
    settings: dict[str, Any] = {
        "concurrency": concurrency,
        "seed": cfg.seed,
        "num_repeats": cfg.num_repeats,
        "max_retries": cfg.max_retries,
        "backoff_s": cfg.backoff_s,
    }
    async with client:
        if make_env is not None and cfg.environment is not None:
            collector: Collector = EpisodeCollector(
                client, recorder, environment=cfg.environment, make_env=make_env, **settings
            )
        else:
            collector = Collector(client, recorder, **settings)
        await collector.run(work)
