"""A step's generations from vLLM servers: one request per sample, kept in flight to the bound.

Input: the servers' URLs, the tokenizer, the served model name, the request headers (the
run's secret) and `num_samples_in_parallel` (a number, or `auto`: the collect stage's
adaptive limit, `stages.lib.api.adaptive.AdaptiveLimit`, which ramps to the servers'
knee and keeps tracking it from step to step). Output: per prompt, its samples as
`Generation`s (token ids, the sampling distribution's log-probabilities), and `stats` of the
latest call: requests in flight (mean and peak), the servers' own queue wait per request
(from their Prometheus `/metrics`, `vllm:request_queue_time_seconds`; None where a server
does not export it) and generated tokens per second.

Every sample of every group is its own request (`n: 1`, seeded per prompt and sample as the
collect stage seeds them) and carries every sampling field: the temperature, the rest
neutral (`stages.lib.api.sampling`), so the servers sample softmax(logits / temperature) over
the whole vocabulary, the policy the loss assumes, whatever their defaults. All of a
step's requests are submitted at once and the bound decides how many are in flight: a
server batches what it is sent, so a handful of group requests at a time would leave a
GPU engine half idle. A prompt's samples all go to one
server (its prefix cache serves the group). Failed requests are retried with backoff while
retryable (429, 5xx, timeouts, resets), as the collector retries them; one that fails for
good fails the step, naming the server.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from stages.lib.api.adaptive import AdaptiveLimit
from stages.lib.api.client import backoff_delay, classify, sample_seed, status_error
from stages.lib.api.sampling import request_sampling
from stages.lib.chat.prompt import Prompt, prompt_ids
from stages.lib.chat.tokens import answer_text, eos_ids, tool_marker_ids
from stages.lib.model.generate import Generation

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from stages.rl.rollout.generate_args import Sampling

MAX_RETRIES, BACKOFF_S = 4, 0.5
_QUEUE = re.compile(r"^vllm:request_queue_time_seconds_(sum|count)(?:\{[^}]*\})? (\S+)$", re.M)


class Gate:
    """At most `limit` requests in flight (a fixed number, or the adaptive limit's)."""

    def __init__(self, parallel: int | str, adaptive: AdaptiveLimit | None) -> None:
        self.fixed = parallel if isinstance(parallel, int) else None
        self.adaptive = adaptive
        self.in_flight = self.peak = 0
        self._area = 0.0  # integral of in-flight over time
        self._t = time.perf_counter()
        self._open = asyncio.Condition()

    @property
    def limit(self) -> int:
        return self.fixed if self.fixed is not None else self.adaptive.limit  # type: ignore[union-attr]

    def _tick(self) -> float:
        now = time.perf_counter()
        self._area += self.in_flight * (now - self._t)
        self._t = now
        return now

    async def enter(self) -> float:
        async with self._open:
            await self._open.wait_for(lambda: self.in_flight < self.limit)
            now = self._tick()
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            if self.adaptive is not None:
                self.adaptive.on_send(now)
            return now

    async def leave(self, sent: float, failed: bool, overloaded: bool = False) -> None:
        """A request answered (or `failed`: its latency does not count; `overloaded`, a 429
        or a timeout, cuts the adaptive limit), as the collector reports them."""
        async with self._open:
            now = self._tick()
            self.in_flight -= 1
            if self.adaptive is not None:
                self.adaptive.on_done(now, now - sent, -1.0 if failed else sent)
                if overloaded:
                    self.adaptive.on_overload(now)
            self._open.notify_all()

    def mean(self, began: float) -> float:
        now = self._tick()
        return self._area / max(now - began, 1e-9)


class HTTPRollouts:
    """The step's requests to the servers (module docstring)."""

    def __init__(
        self,
        urls: Sequence[str],
        tokenizer: Any,
        served: str,
        headers: dict[str, str],
        timeout_s: float,
        parallel: int | str,
        stops: list[int] | None = None,
    ) -> None:
        self.urls, self.tokenizer, self.served = list(urls), tokenizer, served
        self.markers = tool_marker_ids(tokenizer)  # kept in an answer's text (answer_text)
        self.headers, self.timeout_s, self.parallel = headers, timeout_s, parallel
        self.adaptive = AdaptiveLimit() if parallel == "auto" else None  # kept across steps
        self.stops = eos_ids(tokenizer) if stops is None else stops  # `stages.lib.chat.tokens`
        self.stats: dict[str, Any] = {}

    def generate(
        self, prompts: Sequence[Prompt], *, batch_size: int = 0, **sampling: Unpack[Sampling]
    ) -> list[list[Generation]]:
        """`num_samples` answers per prompt (`batch_size` is the servers' business)."""
        encoded = [prompt_ids(self.tokenizer, p) for p in prompts]
        n, temperature = sampling["num_samples"], sampling["temperature"]
        return asyncio.run(
            self._all(encoded, n, temperature, sampling["max_new_tokens"], sampling["seed"])
        )

    async def _all(
        self, encoded: list[list[int]], n: int, temperature: float, max_tokens: int, seed: int
    ) -> list[list[Generation]]:
        import aiohttp

        gate = Gate(self.parallel, self.adaptive)
        began = time.perf_counter()
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(
            connector=connector, headers=self.headers, timeout=timeout
        ) as session:
            queued = await self._queue_time(session)
            jobs = [
                self._one(
                    session, gate, i, ids, sample_seed(seed, i, s, n), temperature, max_tokens
                )
                for i, ids in enumerate(encoded)
                for s in range(n)
            ]
            flat = await asyncio.gather(*jobs)
            after = await self._queue_time(session)
        elapsed = time.perf_counter() - began
        tokens = sum(g.completion_tokens for g in flat)
        waited = None
        if queued is not None and after is not None and after[1] > queued[1]:
            waited = (after[0] - queued[0]) / (after[1] - queued[1])
        self.stats = {
            "in_flight": round(gate.mean(began), 1),
            "in_flight_peak": gate.peak,
            "parallel_limit": gate.limit,
            "queue_wait_s": None if waited is None else round(waited, 4),
            "gen_tokens_per_s": round(tokens / max(elapsed, 1e-9), 1),
        }
        return [list(flat[i * n : (i + 1) * n]) for i in range(len(encoded))]

    async def _one(
        self,
        session: Any,
        gate: Gate,
        i: int,
        ids: list[int],
        seed: int,
        temperature: float,
        max_tokens: int,
    ) -> Generation:
        body: dict[str, Any] = {
            "model": self.served,
            "prompt": ids,
            "n": 1,
            "max_tokens": max_tokens,
            **request_sampling(temperature),  # the loss's policy: softmax(logits / T), no more
            "return_token_ids": True,
            "skip_special_tokens": True,
            "stop_token_ids": self.stops,  # every end-of-answer id, the template's among them
            "seed": seed,
        }
        if temperature > 0:
            body["logprobs"] = 0
        url = f"{self.urls[i % len(self.urls)]}/v1/completions"
        data = json.dumps(body)
        for attempt in range(MAX_RETRIES + 1):
            sent = await gate.enter()
            try:
                async with session.post(url, data=data) as resp:
                    if resp.status == 200:
                        choice = (await resp.json())["choices"][0]
                        await gate.leave(sent, False)
                        break
                    text = (await resp.text())[:300]
                    raise status_error(resp.status, text, resp.headers.get("Retry-After"))
            except Exception as exc:
                error = classify(exc)
                await gate.leave(sent, True, error.kind in ("rate_limited", "timeout"))
            if not error.retryable or attempt == MAX_RETRIES:
                raise RuntimeError(f"{url}: {error}") from None
            await asyncio.sleep(backoff_delay(attempt, BACKOFF_S, error.retry_after))
        else:
            raise AssertionError("the loop breaks or raises on its last attempt")
        try:
            return self.generation(choice, ids, scored="logprobs" in body)
        except ValueError as exc:  # an answer the loss cannot take: the step fails, named
            raise RuntimeError(f"{url}: {exc}") from None

    def generation(
        self, choice: dict[str, Any], prompt: list[int], scored: bool = False
    ) -> Generation:
        """A completions choice as a `Generation`; `scored`: the request asked for
        log-probabilities, and the answer has one per token id (`stop_token`: a stop id the
        ids leave out joins them only with the log-probability the engine reported for it)."""
        ids = [int(t) for t in choice.get("token_ids") or []]
        lps = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        stopped = choice.get("finish_reason") == "stop"
        end = stop_token(choice, ids, self.stops, self.tokenizer.eos_token_id) if stopped else None
        if end is not None and (not scored or len(lps) > len(ids)):
            ids.append(end)  # sampled, and scored by the engine where scores were asked for
        if scored and len(lps) < len(ids):
            raise ValueError(
                f"an answer of {len(ids)} token ids came with {len(lps)} log-probabilities: the "
                "loss needs the engine's log-probability of every token it trains"
            )
        text = choice.get("text", "")
        if self.markers & set(ids):  # the server's text lost the call's markers
            text = answer_text(self.tokenizer, ids)
        return Generation(
            text=text,
            finish_reason="stop" if stopped else "length",
            prompt_tokens=len(prompt),
            completion_tokens=len(ids),
            token_ids=tuple(ids),
            logprobs=tuple(lps[: len(ids)]),
            prompt_ids=tuple(prompt),
        )

    async def _queue_time(self, session: Any) -> tuple[float, float] | None:
        """The servers' summed queue time and request count so far (None: not exported)."""
        total = count = 0.0
        for url in self.urls:
            try:
                async with session.get(f"{url}/metrics") as resp:
                    if resp.status != 200:
                        return None
                    text = await resp.text()
            except Exception:  # a server without metrics: the record says None
                return None
            found = _QUEUE.findall(text)
            if not found:
                return None
            total += sum(float(v) for k, v in found if k == "sum")
            count += sum(float(v) for k, v in found if k == "count")
        return total, count


def stop_token(choice: dict[str, Any], ids: list[int], stops: list[int], eos: Any) -> int | None:
    """The sampled stop token a stopped answer's `token_ids` leave out, None if they hold it.

    An answer ending in any stop id (`stages.lib.chat.tokens.eos_ids`: `<|endoftext|>` as well as
    `<|im_end|>`) holds it, and nothing is added: no token joins a sequence that the engine
    did not sample. vLLM's V1 engine keeps the stop id in `token_ids`, its log-probability
    among the others (its detokenizer leaves it out of the text only). Otherwise the
    engine's `stop_reason` says what it sampled: a token id, or none for the tokenizer's
    end-of-sequence token; a stop string adds nothing. A sampled answer takes the id only
    with the log-probability the engine reported for it (`HTTPRollouts.generation`): the
    loss trains no token without its behaviour log-probability."""
    reason = choice.get("stop_reason")
    if ids and (ids[-1] in stops or ids[-1] == reason):
        return None
    if isinstance(reason, int) and not isinstance(reason, bool):
        return reason
    if reason is None and eos is not None and (not ids or ids[-1] != int(eos)):
        return int(eos)
    return None
