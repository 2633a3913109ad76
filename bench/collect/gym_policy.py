"""A stub policy for NeMo Gym's example_single_tool_call, behind NeMo Gym's `vllm_model` server.

    python bench/collect/gym_policy.py --port 0 --capacity 64 --latency-ms 50

Serves `/v1/chat/completions` (and `/v1/models`, `/health`) on 127.0.0.1, as a vLLM server
with a tool parser answers NeMo Gym's `vllm_model` model server: at most `capacity` requests
at once, each taking `latency_ms`, the rest waiting in FIFO order (as
bench/collect/fake_server.py). The answers script a model that uses example_single_tool_call's
one tool, `get_weather`, whose `/verify` gives reward 1.0 to an episode with a call of it:

- no tool output in the conversation yet: a structured `tool_calls` answer, `get_weather`
  with the city the user asks about, except for the rows `declines(text)` picks (a quarter,
  from a hash of the user's last message), answered in text without a call: reward 0.0;
- after the tool's output: a final message repeating it.

So the rewards differ from row to row, the same in every run. `start_subprocess(...)` runs it
in its own process (its CPU is not the collectors') and returns a handle with `.url` (the
OpenAI base URL), `.pid` and `.stop()`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import zlib
from typing import Any

from aiohttp import web


def declines(text: str) -> bool:
    """Whether the stub answers the user's `text` without calling the tool (reward 0.0)."""
    return zlib.crc32(text.encode()) % 4 == 0


def expected_reward(row: dict[str, Any]) -> float:
    """The reward NeMo Gym's `/verify` gives a row answered by this stub."""
    users = [m for m in row["responses_create_params"]["input"] if m["role"] == "user"]
    return 0.0 if declines(users[-1]["content"]) else 1.0


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content or "")


def answer(body: dict[str, Any]) -> dict[str, Any]:
    """The chat message and finish reason for a request (module docstring)."""
    messages = body["messages"]
    tool_out = [m for m in messages if m.get("role") == "tool"]
    if tool_out:
        return {"role": "assistant", "content": f"Here it is: {_text(tool_out[-1]['content'])}"}
    user = _text(next(m for m in reversed(messages) if m.get("role") == "user")["content"])
    if declines(user):
        return {"role": "assistant", "content": "I cannot look that up, sorry."}
    city = "sf" if "sf" in user else "nyc"
    call = {
        "id": f"call_{zlib.crc32(user.encode()):08x}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    return {"role": "assistant", "content": None, "tool_calls": [call]}


class Stub:
    """The aiohttp application: capacity slots, fixed latency, scripted answers."""

    def __init__(self, capacity: int, latency_s: float) -> None:
        self.capacity, self.latency_s = capacity, latency_s
        self.slots: asyncio.Semaphore | None = None
        self.requests = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 << 20)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests += 1
        if self.slots is None:
            self.slots = asyncio.Semaphore(self.capacity)
        async with self.slots:
            await asyncio.sleep(self.latency_s)
        message = answer(body)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        prompt = sum(len(_text(m.get("content")).split()) for m in body["messages"])
        out = {
            "id": f"chatcmpl-{self.requests}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "stub"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 8, "total_tokens": prompt + 8},
        }
        return web.json_response(out)


class Handle:
    """The stub running in a child process."""

    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self.proc, self.pid = proc, proc.pid
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


def start_subprocess(capacity: int, latency_ms: float) -> Handle:
    """Start the stub in a child process on a free port; returns once it listens."""
    cmd = [sys.executable, __file__, "--port", "0", "--capacity", str(capacity)]
    cmd += ["--latency-ms", str(latency_ms), "--exit-with-stdin"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"the stub policy did not start: {line!r}")
    return Handle(proc, int(line.split()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--capacity", type=int, default=64)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--exit-with-stdin", action="store_true")
    args = parser.parse_args()
    if args.exit_with_stdin:  # exit when the parent that piped stdin is gone
        threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    stub = Stub(args.capacity, args.latency_ms / 1000)

    async def run() -> None:
        runner = web.AppRunner(stub.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", args.port, backlog=4096)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print(f"listening on {port}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
