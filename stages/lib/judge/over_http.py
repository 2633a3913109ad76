"""A served judge's client, on an event loop of its own: every caller's requests share it.

Input: the judge's backend block (`openai`: its URL, model and key) and its settings
(`concurrency`, `judge_max_tokens`, `judge_timeout_s`). Output: `ServedJudge`, whose
`submit(prompt)` returns a future of the judge's answer text (None: the request failed for
good, after retries with backoff), at most `concurrency` requests in flight over one HTTP
session, whichever thread or event loop asks (collect's collector awaits it from its own loop;
evaluate waits on many at once). `close` ends the loop and the session.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stages.lib.config import Verifier

log = logging.getLogger("pipe.stages.judge")


@dataclass(frozen=True)
class _Settings:
    """What a served judge's requests are sent with: greedy, short."""

    max_output_tokens: int
    timeout_s: float
    temperature: float = 0.0
    top_p: float = 1.0


@dataclass(frozen=True)
class _Prompt:
    idx: int
    messages: list[dict[str, str]] | None
    text: str | None = None


class ServedJudge:
    """The judge's HTTP client on a daemon thread's event loop, opened on first use."""

    def __init__(self, cfg: Verifier) -> None:
        assert cfg.backend is not None
        self.cfg, self.backend = cfg, cfg.backend
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None
        self._gate: asyncio.Semaphore | None = None
        self._exit = contextlib.ExitStack()
        self._lock = threading.Lock()

    def submit(
        self, prompt: str, then: Callable[[str | None], None]
    ) -> concurrent.futures.Future[str | None]:
        """The judge's answer to `prompt`, as a future; `then(answer)` runs before it resolves
        (the cache written before any caller reads it)."""
        loop = self._started()

        async def asked() -> str | None:
            text = await self._ask(prompt)
            then(text)
            return text

        return asyncio.run_coroutine_threadsafe(asked(), loop)

    def close(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return
        if self._client is not None:
            asyncio.run_coroutine_threadsafe(
                self._client.__aexit__(None, None, None), loop
            ).result()
        loop.call_soon_threadsafe(loop.stop)
        self._exit.close()

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is not None:
                return self._loop
            from stages.lib.backends.endpoint import Serving, make_client

            endpoint = self._exit.enter_context(self.backend.open_endpoint(Serving(log)))
            settings = _Settings(self.cfg.judge_max_tokens, self.cfg.judge_timeout_s)
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="pipe-judge", daemon=True).start()

            async def opened() -> None:
                self._gate = asyncio.Semaphore(self.cfg.concurrency)
                client = make_client(settings, endpoint, self.cfg.concurrency)
                self._client = await client.__aenter__()

            asyncio.run_coroutine_threadsafe(opened(), loop).result()
            self._loop = loop
            return loop

    async def _ask(self, prompt: str) -> str | None:
        from stages.lib.api.client import complete_retrying

        client = self._client
        url, head = client.prepare(_Prompt(0, [{"role": "user", "content": prompt}], prompt))
        try:
            done = await complete_retrying(client, url, f"{head}0}}".encode(), self._gate, 4, 0.5)
        except Exception as exc:  # counted as unscored: no score, not a zero
            log.warning("judge: a request failed for good: %s", exc)
            return None
        return str(done.text)
