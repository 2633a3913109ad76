"""A capacity-limited fake OpenAI server for benchmarks and tests.

    python bench/collect/fake_server.py --port 8123 --capacity 128 --latency-ms 200

Serves /v1/chat/completions and /v1/completions (plus /health and /v1/models)
on 127.0.0.1. At most `capacity` requests are served at once, each taking
`latency_ms`; the rest wait in FIFO order. Optional injected faults, drawn per
request from a seeded RNG before it queues: HTTP 500, HTTP 429, a connection
reset (RST), or a hang (no answer for `hang_s`, holding no capacity). The
answer is deterministic: `<answer>N</answer>` with N = `expected_answer(text)`
for the last message's content (chat) or the prompt (completions). A completions prompt
given as token ids (as the rl stage sends it to vLLM) is answered as vLLM answers with
`return_token_ids` and `logprobs`: the answer's `token_ids` (`ANSWER_IDS`) and, when the
request asks for them, each one's log-probability (`-0.5`), each request taking one slot
whatever its `n`. With `stop = (ID, how)` the answer stops on the stop id ID (log-probability
`-0.25`, `stop_reason` ID): `how` "kept" as vLLM's V1 engine answers (the id ends
`token_ids`, its log-probability among the others), "left_out" (neither holds it),
"left_out_scored" (`token_ids` leave it out, the log-probabilities hold it).

With `tools` (`--tools`), chat answers script a model that uses the calculator
environment (`stages.lib.env.builtin.calculator`): a message holding an
arithmetic expression (`12 * 7`) is answered `calc: 12 * 7`, a `result: N`
message `<answer>N</answer>`; any other message gets the usual answer.

With `defaults` (a dict: a checkpoint's `generation_config.json` sampling fields) the
server fills what a request leaves out as vLLM's `--generation-config auto` does
(`CompletionRequest.to_sampling_params`: the request's value, else the server's default,
else OpenAI's) and, with `record_bodies`, records each request's effective sampling in
`counters.sampled` beside its body.

Importable: `start_in_thread(...)` runs it in a daemon thread of the caller's
process (tests), `start_subprocess(...)` in its own process (benchmarks, so
its CPU is not charged to the collector). Both return a handle with `.url`
(the OpenAI base URL) and `.stop()`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import socket
import struct
import subprocess
import sys
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


def expected_answer(text: str) -> str:
    """The number the fake server answers for a prompt text."""
    return str(zlib.crc32(text.encode()) % 1000)


@dataclass
class Faults:
    """Per-request probabilities of each injected fault."""

    error_500: float = 0.0
    error_429: float = 0.0
    reset: float = 0.0
    hang: float = 0.0
    hang_s: float = 3600.0


@dataclass
class Counters:
    requests: int = 0
    served: int = 0
    peak_in_service: int = 0
    in_service: int = 0
    injected: dict[str, int] = field(default_factory=dict)
    authorizations: set[str] = field(default_factory=set)
    bodies: list[dict[str, Any]] = field(default_factory=list)  # kept only when record_bodies
    sampled: list[dict[str, Any]] = field(default_factory=list)  # each body's effective sampling


# vLLM's own defaults, where neither the request nor the server's `defaults` say
OPENAI_SAMPLING = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}


def effective_sampling(body: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """What a vLLM server samples a request with: its value, else the server's default."""
    return {
        name: body[name] if body.get(name) is not None else defaults.get(name, default)
        for name, default in OPENAI_SAMPLING.items()
    }


class FakeServer:
    """The aiohttp application and its state."""

    def __init__(
        self, capacity: int, latency_s: float, faults: Faults | None = None, seed: int = 0
    ) -> None:
        self.capacity = capacity
        self.latency_s = latency_s
        self.faults = faults or Faults()
        self.rng = random.Random(seed)
        self.counters = Counters()
        self.record_bodies = False
        self.defaults: dict[str, Any] = {}  # sampling defaults, as a generation_config's
        self.tools = False  # script calculator tool calls (module docstring)
        self.stop: tuple[int, str] | None = None  # token answers stop on an id (docstring)
        self._slots: asyncio.Semaphore | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        text = body["messages"][-1]["content"]
        scripted = tool_answer(text) if self.tools else None
        return await self._serve(request, text, chat=True, completion=scripted)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt = body["prompt"]
        if isinstance(prompt, list):  # token ids: the rl stage's requests
            scored = body.get("logprobs") is not None
            text = " ".join(map(str, prompt))
            return await self._serve(request, text, chat=False, ids=True, scored=scored)
        return await self._serve(request, prompt, chat=False)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        body: dict[str, Any] = await request.json()
        auth = request.headers.get("Authorization")
        if auth is not None:
            self.counters.authorizations.add(auth)
        if self.record_bodies:
            self.counters.bodies.append(body)
            self.counters.sampled.append(effective_sampling(body, self.defaults))
        return body

    def _fault(self) -> str | None:
        f, roll = self.faults, self.rng.random()
        for name, p in (
            ("error_500", f.error_500),
            ("error_429", f.error_429),
            ("reset", f.reset),
            ("hang", f.hang),
        ):
            if roll < p:
                self.counters.injected[name] = self.counters.injected.get(name, 0) + 1
                return name
            roll -= p
        return None

    async def _serve(
        self,
        request: web.Request,
        text: str,
        *,
        chat: bool,
        completion: str | None = None,
        ids: bool = False,
        scored: bool = True,
    ) -> web.StreamResponse:
        self.counters.requests += 1
        fault = self._fault()
        if fault is not None:
            return await self._inject(request, fault)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.capacity)
        async with self._slots:
            c = self.counters
            c.in_service += 1
            c.peak_in_service = max(c.peak_in_service, c.in_service)
            try:
                if self.latency_s > 0:
                    await asyncio.sleep(self.latency_s)
            finally:
                c.in_service -= 1
        self.counters.served += 1
        body = _token_answer(scored, self.stop) if ids else _answer(text, chat, completion)
        return web.Response(body=body, content_type="application/json")

    async def _inject(self, request: web.Request, fault: str) -> web.StreamResponse:
        if fault == "error_500":
            return web.Response(status=500, text="injected server error")
        if fault == "error_429":
            return web.Response(status=429, text="injected rate limit")
        if fault == "hang":
            await asyncio.sleep(self.faults.hang_s)
            return web.Response(status=504, text="hung")
        transport = request.transport
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        raise asyncio.CancelledError


_EXPRESSION = re.compile(r"\d+(?:\s*[-+*/]\s*\d+)+")


def tool_answer(text: str) -> str | None:
    """The scripted tool-using answer to a message (module docstring), or None."""
    if text.startswith("result: "):
        return f"<answer>{text[len('result: ') :].strip()}</answer>"
    found = _EXPRESSION.search(text)
    return f"calc: {found.group(0)}" if found else None


def _answer(text: str, chat: bool, completion: str | None = None) -> bytes:
    if completion is None:
        completion = f"<answer>{expected_answer(text)}</answer>"
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
    if chat:
        choice["message"] = {"role": "assistant", "content": completion}
    else:
        choice["text"] = completion
    usage = {"prompt_tokens": len(text.split()), "completion_tokens": 4, "total_tokens": 0}
    usage["total_tokens"] = usage["prompt_tokens"] + 4
    return json.dumps(
        {"id": "fake", "object": "chat.completion", "choices": [choice], "usage": usage}
    ).encode()


ANSWER_IDS = (11, 12, 13)


def _token_answer(scored: bool, stop: tuple[int, str] | None) -> bytes:
    """A completions answer with token ids and their log-probabilities (vLLM's fields), cut
    at `length`, or stopped on a stop id (module docstring)."""
    ids, lps = list(ANSWER_IDS), [-0.5] * len(ANSWER_IDS)
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "text": "<answer>1</answer>"}
    if stop is not None:
        choice.update(finish_reason="stop", stop_reason=stop[0])
        if stop[1] != "left_out":
            lps.append(-0.25)
        if stop[1] == "kept":
            ids.append(stop[0])
    choice["token_ids"] = ids
    choice["logprobs"] = {"token_logprobs": lps} if scored else None
    usage = {"prompt_tokens": 0, "completion_tokens": len(ids)}
    return json.dumps({"id": "fake", "choices": [choice], "usage": usage}).encode()


async def serve(server: FakeServer, port: int) -> tuple[web.AppRunner, int]:
    """Start serving on 127.0.0.1:port (0: a free port); returns the runner and the port."""
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
    await site.start()
    sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr]
    return runner, sockets[0].getsockname()[1]


class ThreadHandle:
    """A fake server running in a daemon thread of this process."""

    def __init__(self, server: FakeServer) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-openai")
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fake server did not start within 10 s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._runner, self.port = self.loop.run_until_complete(serve(self.server, 0))
        self._ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        async def shutdown() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def start_in_thread(
    capacity: int = 64, latency_ms: float = 0.0, faults: Faults | None = None, seed: int = 0
) -> ThreadHandle:
    """Start a fake server in a daemon thread; `.url`, `.server.counters`, `.stop()`."""
    return ThreadHandle(FakeServer(capacity, latency_ms / 1000, faults, seed))


class ProcessHandle:
    """A fake server running in its own process."""

    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}/v1"

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def start_subprocess(capacity: int = 64, latency_ms: float = 0.0, *extra: str) -> ProcessHandle:
    """Start a fake server in a child process on a free port; returns once it listens."""
    cmd = [sys.executable, __file__, "--port", "0", "--capacity", str(capacity)]
    cmd += ["--latency-ms", str(latency_ms), "--exit-with-stdin", *extra]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        raise RuntimeError(f"the fake server did not start: {line!r}")
    return ProcessHandle(proc, int(line.split()[-1]))


def _exit_on_eof() -> None:
    sys.stdin.read()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--capacity", type=int, default=128)
    parser.add_argument("--latency-ms", type=float, default=200.0)
    parser.add_argument("--error-500", type=float, default=0.0)
    parser.add_argument("--error-429", type=float, default=0.0)
    parser.add_argument("--reset", type=float, default=0.0)
    parser.add_argument("--hang", type=float, default=0.0)
    parser.add_argument("--hang-s", type=float, default=3600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tools", action="store_true", help="script calculator tool calls")
    parser.add_argument(
        "--exit-with-stdin",
        action="store_true",
        help="exit when stdin closes (the parent that piped it is gone)",
    )
    args = parser.parse_args()
    if args.exit_with_stdin:
        threading.Thread(target=_exit_on_eof, daemon=True).start()
    faults = Faults(args.error_500, args.error_429, args.reset, args.hang, args.hang_s)
    server = FakeServer(args.capacity, args.latency_ms / 1000, faults, args.seed)
    server.tools = args.tools

    async def run() -> None:
        _, port = await serve(server, args.port)
        print(f"listening on {port}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
