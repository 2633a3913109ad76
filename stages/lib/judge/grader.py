"""A judge's requests: the uncached answers graded concurrently, each reward read and counted.

Input: a judge `Verifier` and the run folder (its cache file: `stages.lib.judge.answers`).
Output: `Judge`, a verifier's `score(row, completion) -> float` (what collect, evaluate and
rl call per answer) and `score_many(pairs)`, every pair's reward or `Unjudged` (what a caller
holding many answers calls: the uncached ones graded at once, at most `concurrency` in
flight). A served judge (`backend: {kind: openai}`) gets chat requests at temperature 0,
retried with backoff while they fail in a retryable way; a local one (`kind: local`) answers
in batches of `concurrency` in the stage's process, greedily. Repeated answers in one call are
graded once.

A judge answer that holds no score is a failure, counted (`unparsed`), never a zero reward:
`score` raises `Unjudged` (a ValueError), and each caller treats the sample as it treats a
verifier that failed, with the count in its metrics (`counts`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from stages.lib.config import Verifier
from stages.lib.judge.answers import CACHE_FILE, JudgeCache, cache_key
from stages.lib.judge.reading import question_of, read_score, render

log = logging.getLogger("pipe.stages.judge")
T = TypeVar("T")
Pair = tuple[dict[str, Any], str]


class Unjudged(ValueError):
    """The judge's answer holds no score (or the judge could not be asked)."""


@dataclass(frozen=True)
class _Settings:
    """What a served judge's requests are sent with: greedy, short."""

    max_output_tokens: int
    timeout_s: float
    temperature: float = 0.0
    top_p: float = 1.0


class Judge:
    """A verifier whose rewards an LLM gives (`kind: judge`)."""

    def __init__(self, cfg: Verifier, run_dir: str | None = None) -> None:
        assert cfg.kind == "judge" and cfg.backend is not None and cfg.template is not None
        self.cfg, self.backend = cfg, cfg.backend
        path = f"{run_dir.rstrip('/')}/{CACHE_FILE}" if run_dir else None
        self.cache = JudgeCache(path)
        self.requests = 0  # answers asked of the judge (not cached)
        self.unparsed = 0  # answers (cached ones included) holding no score
        self._lock = threading.Lock()

    def __call__(self, row: dict[str, Any], completion: str) -> float:
        result = self.score_many([(row, completion)])[0]
        if isinstance(result, Unjudged):
            raise result
        return result

    def counts(self) -> dict[str, int]:
        """The figures a stage reports: requests sent, cache hits, unparsed answers."""
        return {
            "judge_requests": self.requests,
            "judge_cache_hits": self.cache.hits,
            "judge_unparsed": self.unparsed,
        }

    def score_many(self, pairs: Sequence[Pair]) -> list[float | Unjudged]:
        """Every pair's reward in [0, 1], or `Unjudged` for one the judge's answer holds no
        score for; the uncached pairs asked at once, each distinct prompt once."""
        model = str(self.backend.model)
        template = str(self.cfg.template)
        keys, prompts = [], {}
        texts: dict[str, str] = {}
        for row, completion in pairs:
            key = cache_key(model, template, question_of(row), completion)
            keys.append(key)
            cached = self.cache.get(key) if key not in prompts else None
            if cached is not None:
                texts[key] = cached
            elif key not in texts:
                prompts[key] = render(self.cfg, row, completion)
        if prompts:
            asked = self._ask(list(prompts.values()))
            with self._lock:
                self.requests += len(prompts)
            for key, text in zip(prompts, asked, strict=True):
                if text is not None:
                    self.cache.put(key, text)
                    texts[key] = text
        return [self._read(texts.get(key)) for key in keys]

    def _read(self, text: str | None) -> float | Unjudged:
        score = read_score(self.cfg, text) if text is not None else None
        if score is not None:
            return score
        with self._lock:
            self.unparsed += 1
            first = self.unparsed == 1
        shown = "no answer (the request failed)" if text is None else repr(text[:200])
        if first:
            log.warning("judge: an answer without a score (not a zero reward): %s", shown)
        return Unjudged(f"the judge's answer holds no score: {shown}")

    def _ask(self, prompts: list[str]) -> list[str | None]:
        engine = self.backend.in_process()
        if engine is not None:
            out = engine.generate(
                str(self.backend.model),
                prompts,
                batch_size=self.cfg.concurrency,
                num_samples=1,
                temperature=0.0,
                max_new_tokens=self.cfg.judge_max_tokens,
            )
            return [sample[0].text for sample in out]
        return _run(self._ask_served(prompts))

    async def _ask_served(self, prompts: list[str]) -> list[str | None]:
        from stages.lib.api.client import complete_retrying
        from stages.lib.backends.endpoint import Serving, make_client

        settings = _Settings(self.cfg.judge_max_tokens, self.cfg.judge_timeout_s)
        gate = asyncio.Semaphore(self.cfg.concurrency)
        with self.backend.open_endpoint(Serving(log)) as endpoint:
            async with make_client(settings, endpoint, self.cfg.concurrency) as client:

                async def one(i: int, prompt: str) -> str | None:
                    url, head = client.prepare(
                        _Prompt(i, [{"role": "user", "content": prompt}], prompt)
                    )
                    try:
                        done = await complete_retrying(
                            client, url, f"{head}0}}".encode(), gate, 4, 0.5
                        )
                    except Exception as exc:  # counted as unparsed: no score, not a zero
                        log.warning("judge: request failed: %s", exc)
                        return None
                    return done.text

                return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


@dataclass(frozen=True)
class _Prompt:
    idx: int
    messages: list[dict[str, str]] | None
    text: str | None = None


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to its end from synchronous code, also from inside a running event loop
    (collect's recorder): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    result: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(coro))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, name="pipe-judge")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]
