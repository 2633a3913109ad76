"""The HTTP client's pure parts: error classes, backoff, request bodies, response parsing."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from stages.collect.inputs import parse_row
from stages.lib.api.client import (
    Completion,
    OpenAIClient,
    RequestError,
    backoff_delay,
    classify,
    parse_completion,
    sample_seed,
    status_error,
)


@pytest.mark.parametrize(
    ("status", "kind", "retryable"),
    [
        (429, "rate_limited", True),
        (500, "server_error", True),
        (502, "server_error", True),
        (503, "server_error", True),
        (504, "server_error", True),
        (408, "http_error", True),
        (400, "http_error", False),
        (401, "http_error", False),
        (404, "http_error", False),
        (422, "http_error", False),
        (501, "server_error", False),
    ],
)
def test_status_codes_are_classified(status: int, kind: str, retryable: bool):
    err = status_error(status, "  oops  ", None)
    assert (err.kind, err.retryable, str(err)) == (kind, retryable, f"{kind}: HTTP {status}: oops")


def test_retry_after_is_read_when_numeric():
    assert status_error(429, "", "2.5").retry_after == 2.5
    assert status_error(429, "", "Wed, 21 Oct 2015 07:28:00 GMT").retry_after is None


def test_exceptions_are_classified():
    assert classify(asyncio.TimeoutError()).kind == "timeout"
    assert classify(aiohttp.ServerTimeoutError()).kind == "timeout"
    for exc in (
        aiohttp.ServerDisconnectedError(),
        aiohttp.ClientOSError(104, "Connection reset by peer"),
        ConnectionResetError(104, "reset"),
        aiohttp.ClientPayloadError("truncated"),
    ):
        err = classify(exc)
        assert (err.kind, err.retryable) == ("connection", True), exc
    internal = classify(KeyError("x"))
    assert (internal.kind, internal.retryable) == ("internal", False)
    same = RequestError("bad_response", "x", retryable=True)
    assert classify(same) is same


def test_backoff_is_exponential_capped_and_jittered():
    rng = random.Random(0)
    for attempt, ceiling in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (6, 30.0), (100, 30.0)]:
        delays = [backoff_delay(attempt, 0.5, rng=rng) for _ in range(200)]
        assert ceiling / 2 <= min(delays) and max(delays) <= ceiling
        assert max(delays) - min(delays) > ceiling / 4  # jittered, not fixed
    assert backoff_delay(0, 0.5, retry_after=3.0, rng=rng) == 3.0
    assert backoff_delay(0, 0.5, retry_after=999.0, rng=rng) == 30.0


def test_seeds_differ_per_sample_and_are_reproducible():
    seeds = {sample_seed(0, p, s, 4) for p in range(100) for s in range(4)}
    assert len(seeds) == 400
    assert sample_seed(3, 10, 2, 4) == sample_seed(3, 10, 2, 4) != sample_seed(4, 10, 2, 4)


def _client(endpoint: str, base: str = "http://h:1/v1/") -> OpenAIClient:
    sampling = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 16}
    return OpenAIClient(base, "m", endpoint=endpoint, sampling=sampling, timeout_s=5, api_key="k")


def test_request_bodies_for_each_endpoint():
    text = parse_row(0, '{"prompt": "héllo \\"x\\""}')
    chat = parse_row(1, '{"messages": [{"role": "user", "content": "hi"}]}')
    url, prefix = _client("chat").prepare(text)
    assert url == "http://h:1/v1/chat/completions"
    assert json.loads(prefix + "5}") == {
        "model": "m",
        "messages": [{"role": "user", "content": 'héllo "x"'}],
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 16,
        "seed": 5,
    }
    url, prefix = _client("completions").prepare(text)
    assert url == "http://h:1/v1/completions"
    assert json.loads(prefix + "5}")["prompt"] == 'héllo "x"'
    with pytest.raises(ValueError, match="the completions endpoint needs rows with a 'prompt'"):
        _client("completions").prepare(chat)
    assert _client("auto").prepare(chat)[0].endswith("/chat/completions")
    assert _client("auto").prepare(text)[0].endswith("/v1/completions")
    assert _client("chat").headers["Authorization"] == "Bearer k"


def test_several_base_urls_keep_each_prompt_on_one_server():
    client = _client("chat", "http://a/v1, http://b/v1")
    urls = [client.prepare(parse_row(i, '{"prompt": "x"}'))[0] for i in range(4)]
    assert urls == [
        "http://a/v1/chat/completions",
        "http://b/v1/chat/completions",
        "http://a/v1/chat/completions",
        "http://b/v1/chat/completions",
    ]


def test_responses_are_parsed_or_rejected():
    chat = {
        "choices": [{"message": {"content": "hi"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    assert parse_completion(chat) == Completion("hi", "length", 3, 2)
    plain = {"choices": [{"text": "yo", "finish_reason": "stop"}]}
    assert parse_completion(plain) == Completion("yo", "stop", 0, 0)
    null_content = {"choices": [{"message": {"content": None}, "finish_reason": None}]}
    assert parse_completion(null_content) == Completion("", "unknown", 0, 0)
    for bad in ({"choices": []}, {"error": "x"}, "text", {"choices": [{"nothing": 1}]}):
        with pytest.raises(RequestError) as info:
            parse_completion(bad)
        assert (info.value.kind, info.value.retryable) == ("bad_response", True)
