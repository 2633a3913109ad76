"""OpenAI-compatible HTTP client: one request in, one `Completion` or `RequestError` out.

Input: a base URL (or several joined by commas, e.g. one per vLLM engine:
each prompt goes to one of them, by its index, so its repeats share that
engine's prefix cache), the model name, the endpoint (`chat`, `completions`, or
`auto`: chat for rows with messages, completions for rows with a prompt
string), sampling settings, and an API key (read by the caller from the
environment, or the run's secret of a vLLM server the stage started), sent as
`Authorization: Bearer ...` and never logged, never written. Output: `Completion` objects.

A prompt string sent to a chat endpoint becomes one user message, so the server
applies the model's chat template to it exactly as local generation and
training do (`stages.lib.chat.prompt`); the vLLM backend always uses its chat
endpoint for that reason.

One aiohttp `ClientSession` with a `TCPConnector` sized to the concurrency
(no per-host cap) serves every request. Each request's JSON body is a prefix
built once per prompt plus the per-sample seed, so repeats cost one string
concatenation. Errors are classified into kinds; `retryable` says whether a
retry may help (429, 5xx, 408, timeouts, connection errors, malformed bodies).
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import aiohttp


class Request(Protocol):
    """A prompt to send: its index (which engine), and its chat messages or text."""

    @property
    def idx(self) -> int: ...
    @property
    def messages(self) -> list[dict[str, str]] | None: ...
    @property
    def text(self) -> str | None: ...


_dumps = json.JSONEncoder(ensure_ascii=False).encode
RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
BACKOFF_CAP_S = 30.0


@dataclass(frozen=True, slots=True)
class Completion:
    """A generated answer and what it cost; `tool_calls`: the calls a server parsed (OpenAI's
    `message.tool_calls`, where it was started with a tool-call parser)."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    tool_calls: tuple[dict[str, Any], ...] = ()

    @property
    def answer(self) -> Any:
        """What an episode records: the text, or the structured message with its calls."""
        if not self.tool_calls:
            return self.text
        return {"role": "assistant", "content": self.text, "tool_calls": list(self.tool_calls)}


class RequestError(Exception):
    """A failed request: `kind` names the class of failure, `retryable` whether to retry."""

    def __init__(
        self, kind: str, message: str, *, retryable: bool, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable
        self.retry_after = retry_after

    def __str__(self) -> str:
        return f"{self.kind}: {self.args[0]}"


def classify(exc: BaseException) -> RequestError:
    """Map any exception raised by a request to a RequestError."""
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, asyncio.TimeoutError):
        return RequestError("timeout", "no complete answer within timeout_s", retryable=True)
    if isinstance(exc, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError | OSError):
        return RequestError("connection", f"{type(exc).__name__}: {exc}", retryable=True)
    if isinstance(exc, aiohttp.ClientError):
        return RequestError("client", f"{type(exc).__name__}: {exc}", retryable=True)
    return RequestError("internal", f"{type(exc).__name__}: {exc}", retryable=False)


def status_error(status: int, body: str, retry_after: str | None) -> RequestError:
    """The RequestError for an HTTP status other than 200."""
    if status == 429:
        kind = "rate_limited"
    elif status >= 500:
        kind = "server_error"
    else:
        kind = "http_error"
    wait = None
    if retry_after:
        try:
            wait = float(retry_after)
        except ValueError:
            wait = None
    message = f"HTTP {status}: {body[:200].strip()}"
    return RequestError(kind, message, retryable=status in RETRYABLE_STATUS, retry_after=wait)


def backoff_delay(
    attempt: int, base_s: float, retry_after: float | None = None, rng: random.Random | None = None
) -> float:
    """Seconds to wait before retry `attempt` (0-based): exponential, capped, with jitter.

    The delay is drawn uniformly from [d/2, d] with d = min(30, base_s * 2**attempt);
    a server's Retry-After (capped at 30 s) is a lower bound.
    """
    ceiling = min(BACKOFF_CAP_S, base_s * (1 << min(attempt, 30)))
    draw: float = (rng or random).random()
    delay = ceiling * (0.5 + 0.5 * draw)
    if retry_after is not None:
        delay = max(delay, min(BACKOFF_CAP_S, retry_after))
    return delay


def sample_seed(seed: int, prompt_idx: int, sample_idx: int, num_repeats: int) -> int:
    """A distinct, reproducible seed per (prompt, sample)."""
    return (seed * 1_000_003 + prompt_idx * num_repeats + sample_idx) % 2_147_483_647


class OpenAIClient:
    """Sends chat or completions requests to one OpenAI-compatible server."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        endpoint: str,
        sampling: dict[str, Any],
        timeout_s: float,
        api_key: str | None = None,
        connections: int = 0,
    ) -> None:
        bases = [b.strip().rstrip("/") for b in base_url.split(",") if b.strip()]
        self.chat_urls = [f"{b}/chat/completions" for b in bases]
        self.completions_urls = [f"{b}/completions" for b in bases]
        self.model = model
        self.endpoint = endpoint
        self.sampling = sampling
        # body = head + payload + tail + seed + "}": one concatenation per prompt
        self._head = _dumps({"model": model})[:-1] + ", "
        self._tail = (", " + _dumps(sampling)[1:-1] if sampling else "") + ', "seed": '
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.connections = connections
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> OpenAIClient:
        connector = aiohttp.TCPConnector(limit=self.connections, limit_per_host=0)
        self.session = aiohttp.ClientSession(connector=connector, headers=self.headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    def prepare(self, prompt: Request) -> tuple[str, str]:
        """(url, JSON body without its closing seed) for a prompt; ValueError if unusable."""
        chat = self.endpoint == "chat" or (self.endpoint == "auto" and prompt.messages is not None)
        if chat:
            if prompt.messages is not None:
                payload = f'"messages": {_dumps(prompt.messages)}'
                tools = getattr(prompt, "tools", None)
                if tools:  # rendered by the server's chat template, as OpenAI's API does
                    payload += f', "tools": {_dumps(list(tools))}'
            else:
                payload = (
                    f'"messages": [{{"role": "user", "content": {_dumps(prompt.text or "")}}}]'
                )
        else:
            if prompt.text is None:
                raise ValueError("the completions endpoint needs rows with a 'prompt' string")
            payload = f'"prompt": {_dumps(prompt.text)}'
        urls = self.chat_urls if chat else self.completions_urls
        return urls[prompt.idx % len(urls)], f"{self._head}{payload}{self._tail}"

    async def complete(self, url: str, body: bytes) -> Completion:
        """One request; raises RequestError (or an aiohttp/asyncio error to `classify`)."""
        assert self.session is not None, "use the client as an async context manager"
        return parse_completion(await post_json(self.session, url, body, self.timeout))


async def post_json(
    session: aiohttp.ClientSession, url: str, body: bytes, timeout: aiohttp.ClientTimeout
) -> Any:
    """POST `body`, the answer's JSON; raises RequestError for another status than 200 or a
    body that is not JSON (or an aiohttp/asyncio error to `classify`)."""
    async with session.post(url, data=body, timeout=timeout) as resp:
        if resp.status != 200:
            text = await resp.text(errors="replace")
            raise status_error(resp.status, text, resp.headers.get("Retry-After"))
        raw = await resp.read()
    try:
        return json.loads(raw)  # bytes: UTF-8/16/32 detected by json itself
    except ValueError as exc:
        raise RequestError("bad_response", f"not JSON: {exc}", retryable=True) from exc


def parse_completion(data: Any) -> Completion:
    """The first choice of a chat or completions response."""
    try:
        choice = data["choices"][0]
        message = choice.get("message")
        text = message.get("content") if message is not None else choice["text"]
        usage = data.get("usage") or {}
        calls = (message or {}).get("tool_calls") or ()
        return Completion(
            text or "",
            choice.get("finish_reason") or "unknown",
            int(usage.get("prompt_tokens") or 0),
            int(usage.get("completion_tokens") or 0),
            tuple(calls) if isinstance(calls, list) else (),
        )
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        snippet = json.dumps(data)[:200] if not isinstance(data, str) else data[:200]
        raise RequestError(
            "bad_response", f"unexpected response shape: {snippet}", retryable=True
        ) from exc


@dataclass(frozen=True)
class _Ask:
    idx: int
    messages: list[dict[str, str]] | None
    text: str | None


async def complete_all(
    client: OpenAIClient,
    prompts: list[str | list[dict[str, str]]],
    *,
    num_samples: int,
    seed: int,
    parallel: int = 64,
    max_retries: int = 4,
    backoff_s: float = 0.5,
) -> list[list[Completion]]:
    """Every prompt `num_samples` times through `client`, at most `parallel` requests in
    flight, each retried with backoff while it fails in a retryable way (evaluation: a
    batch to finish, not a stream to keep, unlike the collector)."""
    gate = asyncio.Semaphore(parallel)

    async def one(i: int, prompt: str | list[dict[str, str]], s: int) -> Completion:
        ask = _Ask(i, None, prompt) if isinstance(prompt, str) else _Ask(i, prompt, None)
        url, head = client.prepare(ask)
        body = f"{head}{sample_seed(seed, i, s, num_samples)}}}".encode()
        return await complete_retrying(client, url, body, gate, max_retries, backoff_s)

    async with client:
        flat = await asyncio.gather(
            *(one(i, p, s) for i, p in enumerate(prompts) for s in range(num_samples))
        )
    return [list(flat[i * num_samples : (i + 1) * num_samples]) for i in range(len(prompts))]


R_co = TypeVar("R_co", covariant=True)


class Sends(Protocol[R_co]):
    """A client that posts one request body to a URL (`OpenAIClient`: a `Completion`)."""

    async def complete(self, url: str, body: bytes) -> R_co: ...


async def complete_retrying(
    client: Sends[R_co],
    url: str,
    body: bytes,
    gate: asyncio.Semaphore | None = None,
    max_retries: int = 4,
    backoff_s: float = 0.5,
) -> R_co:
    """One request, retried with backoff while it fails in a retryable way (the gate held
    only while it is in flight); a failure for good raises its RequestError."""
    for attempt in range(max_retries + 1):
        try:
            if gate is None:
                return await client.complete(url, body)
            async with gate:
                return await client.complete(url, body)
        except Exception as exc:
            error = classify(exc)
        if not error.retryable or attempt == max_retries:
            raise error
        await asyncio.sleep(backoff_delay(attempt, backoff_s, error.retry_after))
    raise AssertionError("unreachable")
