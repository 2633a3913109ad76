"""The collector's event loop: a pool of workers, each taking the next (prompt, sample) pair.

Input: an iterator of (Prompt, sample_idx) pairs (read lazily from the input
file), an OpenAIClient, a verifier, a Sink. Output: rollout lines and failure
records in the Sink, counters in Stats.

There is no task per row: `limit` workers each pull the next pair, send it,
retry it with backoff on retryable errors up to `max_retries`, verify the
answer and append the rollout, then pull again. With an AdaptiveLimit the
number of workers follows the controller's limit (new workers start when it
rises; workers retire after their current pair when it falls).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from stages.collect.inputs import ROLLOUT_FIELDS, Prompt
from stages.collect.io import Key, Sink
from stages.collect.stats import Progress, Stats
from stages.lib.api.adaptive import AdaptiveLimit
from stages.lib.api.client import Completion, OpenAIClient, RequestError, backoff_delay, classify
from stages.lib.api.client import sample_seed as _seed
from stages.lib.io.metrics import Metrics
from stages.lib.judge.grader import Unjudged
from stages.lib.verify import Score

T = TypeVar("T")

_dumps = json.JSONEncoder(ensure_ascii=False).encode
_OVERLOAD = frozenset({"rate_limited", "timeout"})


def rollout_line(
    prompt: Prompt, sample_idx: int, out: Completion, reward: float, latency: float, extra: str = ""
) -> str:
    """One rollout as a JSONL line; it starts with its key so resume reads it cheaply."""
    return (
        f'{{"prompt_idx": {prompt.idx}, "sample_idx": {sample_idx}, {prompt.frag}'
        f'"completion": {_dumps(out.text)}, "reward": {reward!r}, '
        f'"finish_reason": {_dumps(out.finish_reason)}, "usage": {{"prompt_tokens": '
        f'{out.prompt_tokens}, "completion_tokens": {out.completion_tokens}}}, '
        f'"latency_s": {latency:.4f}{extra}}}\n'
    )


def failure_record(
    prompt: Prompt, sample_idx: int, error: RequestError, attempts: int, failed_runs: int
) -> dict[str, Any]:
    """The failures-sidecar record of a pair that failed for good in this run."""
    record: dict[str, Any] = {"prompt_idx": prompt.idx, "sample_idx": sample_idx}
    record.update((k, v) for k, v in prompt.row.items() if k not in ROLLOUT_FIELDS)
    record.update(
        error_kind=error.kind,
        error=str(error),
        attempts=attempts,
        failed_runs=failed_runs,
        retryable=error.retryable,
    )
    return record


class Recorder:
    """Turns a finished pair into a rollout line or a failure record, and counts it."""

    def __init__(
        self,
        score: Score,
        sink: Sink,
        stats: Stats,
        failed_runs: dict[Key, int],
        log: logging.Logger,
        track: Metrics | None = None,
    ) -> None:
        self.score, self.sink, self.stats = score, sink, stats
        self.failed_runs = failed_runs
        self.log = log
        self.track = track  # rollouts/s, latency, errors over time, for the run's trackers
        self._verify_warned = False

    def rollout(
        self,
        prompt: Prompt,
        sample_idx: int,
        out: Completion,
        latency: float,
        scored: float | Exception | None = None,
    ) -> None:
        """Record one answer, scored now unless `scored` (a batch's, `score_batch`) is given."""
        if scored is None:
            start = time.perf_counter()
            try:
                scored = self.score(prompt.row, out.text)
            except Exception as exc:
                scored = exc
            self.stats.verify_s += time.perf_counter() - start
        self._record(prompt, sample_idx, out, latency, scored)

    async def rollout_async(
        self, prompt: Prompt, sample_idx: int, out: Completion, latency: float
    ) -> None:
        """`rollout` from the collector's event loop: a verifier that grades asynchronously (a
        served judge, `stages.lib.judge`) is awaited, the other requests going on meanwhile."""
        ascore = getattr(self.score, "ascore", None)
        if ascore is None:
            self.rollout(prompt, sample_idx, out, latency)
            return
        scored: float | Exception
        try:
            scored = await ascore(prompt.row, out.text)
        except Exception as exc:
            scored = exc
        self._record(prompt, sample_idx, out, latency, scored)

    def score_batch(self, pairs: list[tuple[dict[str, Any], str]]) -> list[Any] | None:
        """A batch's rewards (or errors) at once, where the verifier scores many together (a
        judge); None: score each as it is recorded."""
        many = getattr(self.score, "score_many", None)
        if many is None:
            return None
        start = time.perf_counter()
        scored = list(many(pairs))
        self.stats.verify_s += time.perf_counter() - start
        return scored

    def _record(
        self, prompt: Prompt, sample_idx: int, out: Completion, latency: float, scored: Any
    ) -> None:
        stats = self.stats
        if isinstance(scored, Unjudged):  # no score from the judge: a failure, not a zero reward
            error = RequestError("judge_unscored", str(scored), retryable=False)
            self.failure(prompt, sample_idx, error, 0)
            return
        extra = ""
        if isinstance(scored, Exception):
            reward = 0.0
            extra = f', "verify_error": {_dumps(f"{type(scored).__name__}: {scored}")}'
            stats.verify_errors += 1
            if not self._verify_warned:
                self._verify_warned = True
                self.log.warning("verifier failed (reward 0.0, noted in the row): %s", scored)
        else:
            reward = float(scored)
        self.sink.rollout(rollout_line(prompt, sample_idx, out, reward, latency, extra))
        stats.written += 1
        stats.tokens_in += out.prompt_tokens
        stats.tokens_out += out.completion_tokens
        stats.latency.add(latency)

    def failure(self, prompt: Prompt, sample_idx: int, error: RequestError, attempts: int) -> None:
        runs = self.failed_runs.get((prompt.idx, sample_idx), 0) + 1
        self.sink.failure(failure_record(prompt, sample_idx, error, attempts, runs))
        self.stats.failed += 1
        if self.stats.failed <= 3:
            self.log.warning(
                "prompt %d sample %d failed after %d attempts: %s",
                prompt.idx,
                sample_idx,
                attempts,
                error,
            )

    def bad_row(self, prompt: Prompt, sample_idx: int) -> None:
        kind, _, message = (prompt.error or "bad_row: unusable row").partition(": ")
        self.failure(prompt, sample_idx, RequestError(kind, message, retryable=False), 0)


def _raise_mmap_threshold() -> None:
    """Let glibc serve asyncio's 256 KiB socket read buffers from the heap.

    asyncio reads each response into a fresh 256 KiB bytes object; above glibc's
    mmap threshold (128 KiB until a larger mmapped block is freed) that costs an
    mmap, an mremap and a munmap per response (measured here: 3 syscalls a
    rollout while the streamed input file holds its buffer). Freeing one 1 MiB
    block raises the threshold the way glibc's own heuristic does; harmless
    elsewhere.
    """
    block = bytearray(1 << 20)
    del block


class Collector:
    """Runs every pair of an iterator through the client with bounded concurrency."""

    def __init__(
        self,
        client: OpenAIClient,
        recorder: Recorder,
        *,
        concurrency: int | AdaptiveLimit,
        seed: int,
        num_repeats: int,
        max_retries: int,
        backoff_s: float,
    ) -> None:
        self.client, self.recorder = client, recorder
        self.sink, self.stats = recorder.sink, recorder.stats
        self.ctl = concurrency if isinstance(concurrency, AdaptiveLimit) else None
        self.fixed = concurrency if isinstance(concurrency, int) else 0
        self.seed, self.num_repeats = seed, num_repeats
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.progress = Progress(recorder.log, track=recorder.track)
        self._workers = 0
        self._exhausted = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._error: BaseException | None = None
        self._idle = asyncio.Event()
        self._items: Iterator[tuple[Prompt, int]] = iter(())

    def limit(self) -> int:
        return self.ctl.limit if self.ctl is not None else self.fixed

    async def run(self, items: Iterator[tuple[Prompt, int]]) -> None:
        """Process every pair; returns when all are written or failed."""
        self._items = items
        _raise_mmap_threshold()
        self.stats.set_limit(self.limit())
        ticker = asyncio.create_task(self._tick())
        self._grow()
        if self._workers:
            await self._idle.wait()
        ticker.cancel()
        self.sink.flush()
        self.progress.close(self.stats)
        if self._error is not None:
            raise self._error

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.sink.flush_if_due()
            if self.stats.limit != self.limit():
                self.stats.set_limit(self.limit())
            self.progress.maybe_report(self.stats)

    def _grow(self) -> None:
        while not self._exhausted and self._workers < self.limit():
            self._workers += 1
            task = asyncio.create_task(self._worker())
            self._tasks.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()
            self._idle.set()

    async def _worker(self) -> None:
        try:
            while self._workers <= self.limit():
                item = next(self._items, None)
                if item is None:
                    self._exhausted = True
                    break
                await self._one(*item)
        finally:
            self._workers -= 1
            if self._workers == 0:
                self._idle.set()

    async def _one(self, prompt: Prompt, sample_idx: int) -> None:
        if prompt.request is None and prompt.error is None:
            try:
                prompt.request = self.client.prepare(prompt)
            except ValueError as exc:
                prompt.error = f"bad_row: {exc}"
        if prompt.request is None:
            self.recorder.bad_row(prompt, sample_idx)
            return
        url, prefix = prompt.request
        body = f"{prefix}{_seed(self.seed, prompt.idx, sample_idx, self.num_repeats)}}}".encode()
        out, latency, attempts = await self.request(url, body)
        if isinstance(out, RequestError):
            self.recorder.failure(prompt, sample_idx, out, attempts)
        else:
            await self.recorder.rollout_async(prompt, sample_idx, out, latency)

    async def request(self, url: str, body: bytes) -> tuple[Completion | RequestError, float, int]:
        """One request, retried with backoff while it fails in a retryable way: (the
        completion or the last error, the latency of the answered attempt, attempts made)."""
        attempt = 0
        while True:
            result = await self._send(url, body)
            if not isinstance(result, RequestError):
                return result[0], result[1], attempt + 1
            self.stats.errors[result.kind] += 1
            if not result.retryable or attempt >= self.max_retries:
                return result, 0.0, attempt + 1
            await asyncio.sleep(backoff_delay(attempt, self.backoff_s, result.retry_after))
            attempt += 1
            self.stats.retries += 1

    async def _send(self, url: str, body: bytes) -> tuple[Completion, float] | RequestError:
        stats, ctl = self.stats, self.ctl
        start = time.perf_counter()
        stats.in_flight += 1
        if ctl is not None:
            ctl.on_send(start)
        out: Completion | RequestError
        try:
            out = await self.client.complete(url, body)
        except Exception as exc:
            out = classify(exc)
        now = time.perf_counter()
        stats.in_flight -= 1
        if ctl is not None:
            if isinstance(out, RequestError):
                ctl.on_done(now, now - start, -1.0)
                if out.kind in _OVERLOAD:
                    ctl.on_overload(now)
            else:
                ctl.on_done(now, now - start, start)
            if ctl.limit > self._workers:
                self._grow()
        if isinstance(out, RequestError):
            return out
        return out, now - start


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run, or in a fresh thread when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
