"""One parallelism level measured, for `pipe tune`: throughput and latency, nothing written.

Input: a CollectConfig (its backend, sampling settings, timeout and
verifier), prompt rows, a fixed parallelism and a request count. Output: a
`LevelResult`. Requests cycle over `rows` and go through the same client and
verifier as the collector, each sent once (no retries, so errors show), with
exactly `parallelism` requests in flight until `num_requests` have been sent.

For the `local` backend a level is a batch size: prompts are generated in
batches of `parallelism` and a batch's wall time is each of its rollouts'
latency. For `vllm` the server is started for the call and stopped after.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stages.collect.inputs import Prompt, prompt_from_row
from stages.lib.api.client import RequestError, classify, sample_seed
from stages.lib.verify import Score, make_verifier

if TYPE_CHECKING:
    from stages.collect import CollectConfig
    from stages.lib.api.client import OpenAIClient

log = logging.getLogger("pipe.collect.measure")


@dataclass(frozen=True)
class LevelResult:
    """Throughput and latency at one parallelism level."""

    parallelism: int
    rollouts_per_s: float
    p50_s: float
    p95_s: float
    errors: int  # failed requests, timeouts included
    timeouts: int
    verify_s: float  # seconds spent in the verifier
    wall_s: float


def measure_level(
    cfg: CollectConfig, rows: list[dict[str, Any]], parallelism: int, num_requests: int
) -> LevelResult:
    """Send `num_requests` requests at fixed concurrency `parallelism` and time them."""
    if parallelism < 1 or num_requests < 1 or not rows:
        raise ValueError("measure_level needs parallelism >= 1, num_requests >= 1 and rows")
    prompts = [prompt_from_row(i, row) for i, row in enumerate(rows)]
    bad = [p for p in prompts if p.error]
    if bad:
        raise ValueError(f"row {bad[0].idx}: {bad[0].error}")
    score = make_verifier(cfg.verifier)
    if cfg.backend.in_process() is not None:
        return _measure_local(cfg, prompts, score, parallelism, num_requests)
    from stages.lib.backends.endpoint import Serving, make_client

    with cfg.backend.open_endpoint(Serving(log, cfg.backend.engine_gpus())) as endpoint:
        client = make_client(cfg, endpoint, connections=parallelism)
        return asyncio.run(_measure_http(client, cfg, prompts, score, parallelism, num_requests))


@dataclass
class _Tally:
    latencies: list[float]
    errors: int = 0
    timeouts: int = 0
    verify_s: float = 0.0
    sent: int = 0


async def _measure_http(
    client: OpenAIClient,
    cfg: CollectConfig,
    prompts: list[Prompt],
    score: Score,
    parallelism: int,
    num_requests: int,
) -> LevelResult:
    for prompt in prompts:
        prompt.request = client.prepare(prompt)
    tally = _Tally([])

    async def worker() -> None:
        while tally.sent < num_requests:
            n = tally.sent
            tally.sent += 1
            prompt = prompts[n % len(prompts)]
            assert prompt.request is not None
            url, prefix = prompt.request
            body = f"{prefix}{sample_seed(cfg.seed, prompt.idx, n, num_requests)}}}".encode()
            start = time.perf_counter()
            try:
                done = await client.complete(url, body)
            except Exception as exc:
                err = exc if isinstance(exc, RequestError) else classify(exc)
                tally.errors += 1
                tally.timeouts += err.kind == "timeout"
                continue
            tally.latencies.append(time.perf_counter() - start)
            tally.verify_s += _timed_score(score, prompt.row, done.text)

    async with client:
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(parallelism, num_requests))))
        wall = time.perf_counter() - start
    return _result(parallelism, tally, wall)


def _timed_score(score: Score, row: dict[str, Any], text: str) -> float:
    start = time.perf_counter()
    try:
        score(row, text)
    except Exception as exc:
        log.debug("verifier failed: %s", exc)
    return time.perf_counter() - start


def _measure_local(
    cfg: CollectConfig, prompts: list[Prompt], score: Score, parallelism: int, num_requests: int
) -> LevelResult:
    from stages.collect.in_process import precision

    engine, model, loaded = cfg.backend.in_process(), cfg.backend.model, precision(cfg)
    assert engine is not None and model is not None  # the caller's and the kind's checks
    tally = _Tally([])
    start = time.perf_counter()
    while tally.sent < num_requests:
        batch = [prompts[(tally.sent + i) % len(prompts)] for i in range(parallelism)]
        batch = batch[: num_requests - tally.sent]
        t0 = time.perf_counter()
        outs = engine.generate(
            model,
            [p.messages if p.messages is not None else (p.text or "") for p in batch],
            num_samples=1,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_output_tokens,
            seed=cfg.seed + tally.sent,
            batch_size=parallelism,
            dtype=loaded[0] if loaded else None,
        )
        took = time.perf_counter() - t0
        tally.sent += len(batch)
        for prompt, gens in zip(batch, outs, strict=True):
            tally.latencies.append(took)
            tally.verify_s += _timed_score(score, prompt.row, gens[0].text)
    return _result(parallelism, tally, time.perf_counter() - start)


def _result(parallelism: int, tally: _Tally, wall: float) -> LevelResult:
    lat = sorted(tally.latencies)
    return LevelResult(
        parallelism=parallelism,
        rollouts_per_s=len(lat) / wall if wall > 0 else 0.0,
        p50_s=quantile(lat, 0.50),
        p95_s=quantile(lat, 0.95),
        errors=tally.errors,
        timeouts=tally.timeouts,
        verify_s=tally.verify_s,
        wall_s=wall,
    )


def quantile(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted values (nearest rank); 0.0 when empty."""
    if not ordered:
        return 0.0
    rank = max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))
    return ordered[rank]
