"""A judge's rewards: each answer's prompt rendered, asked once, its reply read and counted.

Input: a judge `Verifier` and the run folder (the answers' cache file:
`stages.lib.judge.answers`). Output: `Judge`, a verifier's `score(row, completion) -> float`
(what a caller scoring one answer at a time calls), `score_many(pairs)` (every pair's reward
or `Unjudged`, the uncached ones asked at once: evaluate, collect's in-process batches) and
`ascore` (one answer, awaited from a caller's event loop: collect's collector, whose requests
to the policy go on meanwhile). A served judge (`backend: {kind: openai}`) gets chat requests
at temperature 0 through `stages.lib.judge.over_http` (at most `concurrency` in flight); a local
one (`kind: local`) answers greedily in batches of `concurrency` in the stage's process, on
its CPU. An answer asked for while the same one is in flight waits for it: each distinct
(judge, template, question, answer) costs one request per run folder.

A judge reply that holds no score is a failure, counted (`unparsed`), never a zero reward:
`score` raises `Unjudged` (a ValueError), and each caller treats the sample as it treats a
verifier that failed, with the count in its metrics (`counts`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from typing import Any

from stages.lib.config import Verifier
from stages.lib.judge.answers import CACHE_FILE, JudgeCache, cache_key
from stages.lib.judge.over_http import ServedJudge
from stages.lib.judge.reading import question_of, read_score, render

log = logging.getLogger("pipe.stages.judge")
Pair = tuple[dict[str, Any], str]


class Unjudged(ValueError):
    """The judge's reply holds no score (or the judge could not be asked)."""


class Judge:
    """A verifier whose rewards an LLM gives (`kind: judge`)."""

    def __init__(self, cfg: Verifier, run_dir: str | None = None) -> None:
        assert cfg.kind == "judge" and cfg.backend is not None and cfg.template is not None
        self.cfg, self.model, self.template = cfg, str(cfg.backend.model), cfg.template
        self.cache = JudgeCache(f"{run_dir.rstrip('/')}/{CACHE_FILE}" if run_dir else None)
        self.engine = cfg.backend.in_process()
        self.served = ServedJudge(cfg) if self.engine is None else None
        self.requests = 0  # answers asked of the judge
        self.hits = 0  # answers found in the cache, or asked already by another caller
        self.unparsed = 0  # answers (cached ones included) whose reply holds no score
        self._lock = threading.Lock()
        self._pending: dict[str, concurrent.futures.Future[str | None]] = {}

    def __call__(self, row: dict[str, Any], completion: str) -> float:
        return _raised(self.score_many([(row, completion)])[0])

    def counts(self) -> dict[str, int]:
        """The figures a stage reports: requests sent, answers that cost none, unscored."""
        return {
            "judge_requests": self.requests,
            "judge_cache_hits": self.hits,
            "judge_unparsed": self.unparsed,
        }

    def close(self) -> None:
        """Close a served judge's connections (a local one holds none)."""
        if self.served is not None:
            self.served.close()

    def score_many(self, pairs: Sequence[Pair]) -> list[float | Unjudged]:
        """Every pair's reward in [0, 1], or `Unjudged` where the judge's reply holds no
        score; the answers not seen before asked at once."""
        keys = [self._key(row, completion) for row, completion in pairs]
        texts: dict[str, str | None] = {}
        asked: dict[str, str] = {}
        for key, (row, completion) in zip(keys, pairs, strict=True):
            if key in texts or key in asked:
                self._count(hits=1)
            elif (text := self.cache.get(key)) is not None:
                texts[key] = text
                self._count(hits=1)
            else:
                asked[key] = render(self.cfg, row, completion)
        if asked and self.served is not None:
            futures = {key: self._submit(key, prompt) for key, prompt in asked.items()}
            texts.update({key: future.result() for key, future in futures.items()})
        elif asked:
            self._count(requests=len(asked))
            replies = self._ask_local(list(asked.values()))
            for key, text in zip(asked, replies, strict=True):
                self.cache.put(key, text)
                texts[key] = text
        return [self._read(texts[key]) for key in keys]

    async def ascore(self, row: dict[str, Any], completion: str) -> float:
        """One answer's reward, awaited from the caller's event loop (which goes on)."""
        key = self._key(row, completion)
        text = self.cache.get(key)
        if text is not None:
            self._count(hits=1)
        elif self.served is not None:
            text = await asyncio.wrap_future(self._submit(key, render(self.cfg, row, completion)))
        else:
            return await asyncio.to_thread(self, row, completion)
        return _raised(self._read(text))

    def _key(self, row: dict[str, Any], completion: str) -> str:
        return cache_key(self.model, self.template, question_of(row), completion)

    def _submit(self, key: str, prompt: str) -> concurrent.futures.Future[str | None]:
        """The reply's future: one request per key, however many callers ask meanwhile."""
        assert self.served is not None
        with self._lock:
            future = self._pending.get(key)
            if future is not None:
                self.hits += 1
                return future
            self.requests += 1

            def then(text: str | None) -> None:
                if text is not None:
                    self.cache.put(key, text)
                with self._lock:
                    self._pending.pop(key, None)

            future = self.served.submit(prompt, then)
            self._pending[key] = future
            return future

    def _ask_local(self, prompts: list[str]) -> list[str]:
        assert self.engine is not None
        out = self.engine.generate(
            self.model,
            prompts,
            batch_size=self.cfg.concurrency,
            num_samples=1,
            temperature=0.0,
            max_new_tokens=self.cfg.judge_max_tokens,
        )
        return [sample[0].text for sample in out]

    def _count(self, *, hits: int = 0, requests: int = 0) -> None:
        with self._lock:
            self.hits += hits
            self.requests += requests

    def _read(self, text: str | None) -> float | Unjudged:
        score = read_score(self.cfg, text) if text is not None else None
        if score is not None:
            return score
        with self._lock:
            self.unparsed += 1
            first = self.unparsed == 1
        shown = "no reply (the request failed)" if text is None else repr(text[:200])
        if first:
            log.warning("judge: a reply without a score (not a zero reward): %s", shown)
        return Unjudged(f"the judge's reply holds no score: {shown}")


def _raised(result: float | Unjudged) -> float:
    if isinstance(result, Unjudged):
        raise result
    return result
