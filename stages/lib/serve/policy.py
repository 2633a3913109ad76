"""The policy endpoint: a model in memory served as an OpenAI-compatible HTTP server, what
NeMo Gym's `vllm_model` server calls as its vLLM.

Input: an engine (`stages.lib.serve.batcher.Engine`; `local_engine(model, tokenizer)` for
the local backend's generation), the tokenizer, the served model's name, and where to
listen (127.0.0.1 and a free port by default; an optional bearer key).
Output: a `PolicyServer`, running in a thread of its own (`start()` -> its base URL,
`http://127.0.0.1:<port>/v1`; `stop()`), or its aiohttp application (`app()`).

Routes, as vLLM's OpenAI server answers them:

- `POST /v1/chat/completions` (`stages.lib.serve.wire`): the conversation rendered by the
  checkpoint's chat template with its tools (`stages.lib.chat.prompt.prompt_ids`, the
  rendering every stage shares), generated through the `Batcher` from those ids, the
  answer's tool calls parsed by the template's format (`parser_for`, or the `parser` given)
  into structured `tool_calls`. A conversation whose prompt leaves no room for the answer
  is refused with vLLM's "maximum context length" message (NeMo Gym reads it as a turn cut
  for length); without `max_tokens`, the answer may take what the context leaves, up to
  `max_tokens` (the server's).
  Token in, token out: a history whose last assistant message carries the ids it was asked
  with and answered (`prompt_token_ids`, `generation_token_ids`: NeMo Gym's `vllm_model`
  sends them back when it trains) is extended, not rendered again: the prompt is those ids,
  then the template's ids of what follows that turn (`stages.lib.chat.turns.follow_ids`, as
  the rl stage's `extend` asks a later turn), so every turn's prompt begins with every id
  before it, as NeMo RL requires ("Non-contiguous messages found!"); a template that cannot
  split the conversation there gets the rendering. With `return_tokens_as_token_ids` the
  answer's message carries its own `prompt_token_ids`, `generation_token_ids` and
  `generation_log_probs` (the prompt as generated from, which `/tokenize` cannot say of an
  extended one); NeMo Gym's `vllm_model` takes them as they are.
- `POST /tokenize`: the same rendering's ids (`{"tokens", "count", "max_model_len"}`):
  NeMo Gym takes a turn's prompt ids from here when the completion does not carry them.
- `GET /v1/models` (the served name), `GET /health`.

Every route but `/health` asks for `Authorization: Bearer <api_key>` when a key is set. A
bad request gets 400 with its message; an engine that raises, 500.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from stages.lib.chat.prompt import ChatPrompt, TokenPrompt, prompt_ids
from stages.lib.chat.tokens import answer_end
from stages.lib.chat.tool_calls import parse_tool_calls, parser_for
from stages.lib.chat.turns import follow_ids
from stages.lib.net import LOOPBACK, free_port
from stages.lib.serve.batcher import Batcher, Engine
from stages.lib.serve.wire import (
    BadRequest,
    ChatRequest,
    Sampling,
    chat_completion,
    chat_request,
    error_body,
    logprobs_content,
    tokenize_request,
)

log = logging.getLogger("pipe.stages.lib.serve.policy")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def model_len(model: Any, tokenizer: Any) -> int:
    """The context a model takes: its config's `max_position_embeddings`, else the
    tokenizer's `model_max_length` (when it is a real bound), else 4096."""
    config = getattr(model, "config", None)
    for value in (
        getattr(config, "max_position_embeddings", None),
        getattr(tokenizer, "model_max_length", None),
    ):
        if isinstance(value, int) and 0 < value < 10**8:
            return value
    return 4096


def _json(status: int, body: dict[str, Any]) -> web.Response:
    return web.json_response(body, status=status, dumps=lambda b: json.dumps(b, ensure_ascii=False))


class PolicyServer:
    """The endpoint (module docstring)."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        *,
        name: str = "policy",
        parser: str | None = None,
        host: str = LOOPBACK,
        port: int = 0,
        api_key: str | None = None,
        max_tokens: int = 512,
        max_model_len: int = 4096,
        max_batch: int = 64,
        seed: int = 0,
    ) -> None:
        self.tokenizer, self.name = tokenizer, name
        template = getattr(tokenizer, "chat_template", None)
        self.parser = parser or (parser_for(template) if isinstance(template, str) else None)
        self.host, self.port, self.api_key = host, port or free_port(host), api_key
        self.max_tokens, self.max_model_len = max_tokens, max_model_len
        self.batcher = Batcher(engine, max_batch, seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=256 * 2**20)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The bearer key (where set), and every refusal as a JSON error body."""
        if self.api_key is not None and request.path != "/health":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return _json(401, error_body(401, "missing or wrong bearer key"))
        try:
            return await handler(request)
        except BadRequest as e:
            return _json(400, error_body(400, str(e)))
        except json.JSONDecodeError as e:
            return _json(400, error_body(400, f"the body is not JSON: {e}"))
        except web.HTTPException as e:
            return _json(e.status, error_body(e.status, e.reason))

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pipe",
            "root": self.name,
            "max_model_len": self.max_model_len,
        }
        return _json(200, {"object": "list", "data": [model]})

    def _ids(self, prompt: ChatPrompt | str, generation_prompt: bool = True) -> list[int]:
        """The ids of a prompt as generation sees it (the chat template's rendering)."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        try:
            if generation_prompt:
                return prompt_ids(self.tokenizer, prompt)
            from stages.lib.chat.clock import render

            options: dict[str, Any] = {"tools": list(prompt.tools)} if prompt.tools else {}
            text = render(
                self.tokenizer, list(prompt.messages), add_generation_prompt=False, **options
            )
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        except ValueError as e:  # a template that cannot render tools (`require_tools`)
            raise BadRequest(str(e)) from None
        except Exception as e:  # the template is the checkpoint's code: its error is the request's
            raise BadRequest(
                f"the chat template failed on these messages: {type(e).__name__}: {e}"
            ) from None

    def _prompt(self, req: ChatRequest) -> list[int]:
        """The ids to generate from: the history's sampled ids extended, or the rendering
        (module docstring)."""
        if req.prefix is None:
            return self._ids(req.prompt)
        end = tuple(answer_end(self.tokenizer).ids)
        closed = bool(end) and req.prefix.generation[-len(end) :] == end
        tools = list(req.prompt.tools) or None
        try:
            follow = follow_ids(self.tokenizer, list(req.prompt.messages), closed, tools)
        except ValueError:  # the template renders the turn differently once it goes on
            return self._ids(req.prompt)
        return [*req.prefix.ids, *follow]

    async def tokenize(self, request: web.Request) -> web.Response:
        prompt, flag = tokenize_request(await request.json())
        if isinstance(prompt, str) and not flag:
            ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        else:
            ids = self._ids(prompt, flag)
        return _json(200, {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len})

    def _budget(self, req: ChatRequest, prompt_len: int) -> int:
        """The answer's token budget, or vLLM's context-length refusal."""
        room = self.max_model_len - prompt_len
        wanted = req.max_tokens if req.max_tokens is not None else min(self.max_tokens, room)
        if wanted > room or room <= 0:
            asked = max(wanted, 1)
            raise BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + asked} tokens ({prompt_len} in the messages, "
                f"{asked} in the completion). Please reduce the length of the messages "
                "or completion."
            )
        return wanted

    async def chat(self, request: web.Request) -> web.Response:
        req = chat_request(await request.json())
        ids = self._prompt(req)
        sampling = Sampling(req.temperature, req.top_p, self._budget(req, len(ids)), req.seed)
        try:
            gen = await self.batcher.generate(TokenPrompt(tuple(ids)), sampling)
        except Exception as e:
            log.exception("the engine failed a request")
            return _json(500, error_body(500, f"generation failed: {type(e).__name__}: {e}"))
        reply, finish = self._reply(req, gen.text, gen.finish_reason)
        tokens = list(gen.token_ids)
        if req.token_ids_as_text:  # the turn's ids, as NeMo Gym's training capture reads them
            reply["prompt_token_ids"], reply["generation_token_ids"] = ids, tokens
            reply["generation_log_probs"] = [float(x) for x in gen.logprobs]
        logprobs = None
        if req.logprobs:
            decode = lambda t: self.tokenizer.decode([t])  # noqa: E731
            logprobs = logprobs_content(tokens, gen.logprobs, decode, req.token_ids_as_text)
        body = chat_completion(
            self.name,
            reply,
            finish,
            (len(ids), gen.completion_tokens),
            logprobs,
            (ids, tokens) if req.return_token_ids else None,
        )
        return _json(200, body)

    def _reply(self, req: ChatRequest, text: str, finish: str) -> tuple[dict[str, Any], str]:
        """The assistant message, its tool calls structured where the request offered tools."""
        if req.parse_tools and self.parser is not None:
            parsed = parse_tool_calls(text, self.parser, req.turn)
            if parsed.tool_calls:
                message = {
                    "role": "assistant",
                    "content": parsed.content or None,
                    "tool_calls": parsed.tool_calls,
                }
                return message, "tool_calls"
        return {"role": "assistant", "content": text, "tool_calls": []}, finish

    # running in a thread of its own

    def start(self, timeout_s: float = 30.0) -> str:
        """Serve in a daemon thread with its own event loop; returns the base URL once the
        port listens (RuntimeError when it does not within `timeout_s`)."""
        ready, failed = threading.Event(), []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._runner = web.AppRunner(self.app(), access_log=None)
                loop.run_until_complete(self._runner.setup())
                loop.run_until_complete(web.TCPSite(self._runner, self.host, self.port).start())
            except Exception as e:  # the port taken, the host unknown: start() reports it
                failed.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, name="pipe-policy-server", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s) or failed:
            why = failed[0] if failed else f"not listening after {timeout_s:g}s"
            raise RuntimeError(
                f"the policy endpoint could not start on {self.host}:{self.port}: {why}"
            )
        log.info("serving '%s' at %s", self.name, self.base_url)
        return self.base_url

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and join the thread (requests in flight are dropped)."""
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
        self._thread = None

    def __enter__(self) -> PolicyServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
