"""The run's secret for the vLLM servers we start: made here, checked inside the server.

Input: the secret, handed to the server in its environment (`PIPE_VLLM_SECRET`, never
its command line, which `ps` and logs show). Output: `RequireSecret`, an ASGI middleware
that vLLM's API server loads through `--middleware stages.lib.backends.vllm.auth.RequireSecret`;
it answers 401 to every HTTP request and closes every WebSocket (403) that does not
carry `Authorization: Bearer <secret>`, on every path: the OpenAI routes and vLLM's
development endpoints (`/collective_rpc`, which can load any file as weights, `/sleep`,
`/reset_prefix_cache`, ...) alike, and `/health` too: our own health check sends the
secret, so a port taken by someone else's server is never mistaken for ours. vLLM's own
`--api-key` (`VLLM_API_KEY`) is not enough: its `AuthenticationMiddleware`
(vllm/entrypoints/serve/middleware/authenticate.py) guards only the paths starting with
/v1, /v2, /inference, /cohere.

How vLLM 0.32 applies it (read in vllm/entrypoints/serve/middleware/register.py): each
`--middleware` value is split at its last dot, the module imported with `importlib`, and a
class added with `app.add_middleware(cls)`, without arguments: hence the secret comes
from the environment, read once when the app's middleware stack is built at start-up (a
server without one refuses to start). Added after vLLM's own middlewares (CORS, its
api-key check), it is the outermost of them and sees each request first. The module runs
in vLLM's interpreter, not ours: standard library only, and `stages/__init__.py` and
`stages/lib/__init__.py` import nothing.

The comparison is `hmac.compare_digest` on bytes: its time does not depend on where the
first differing byte is (only on the length, which `secrets.token_urlsafe` fixes).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

SECRET_ENV = "PIPE_VLLM_SECRET"  # not VLLM_*: vLLM warns about, and lists, unknown VLLM_ names
MIDDLEWARE = "stages.lib.backends.vllm.auth.RequireSecret"
SECRET_BYTES = 32

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REFUSED = json.dumps({"error": "Unauthorized: this server requires the run's secret"}).encode()
POLICY_VIOLATION = 1008  # WebSocket close code; a close before accept is an HTTP 403


def new_secret() -> str:
    """A fresh secret for one run of servers (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(SECRET_BYTES)


def bearer(secret: str) -> dict[str, str]:
    """The header every request to a server started with `secret` carries."""
    return {"Authorization": f"Bearer {secret}"}


class RequireSecret:
    """ASGI middleware: only requests bearing `$PIPE_VLLM_SECRET` reach `app`."""

    def __init__(self, app: ASGIApp) -> None:
        secret = os.environ.get(SECRET_ENV, "")
        if not secret:
            raise RuntimeError(f"{SECRET_ENV} is not set: refusing to serve without a secret")
        self.app = app
        self.expected = secret.encode("utf-8")

    def allowed(self, scope: Scope) -> bool:
        """Whether the request has exactly one `Authorization: Bearer <the secret>` header."""
        values = [v for k, v in scope.get("headers") or () if k.lower() == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = bytes(values[0]).strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)  # lifespan events pass, as does the owner
        elif kind == "http":
            await refuse_http(send)
        else:
            await send({"type": "websocket.close", "code": POLICY_VIOLATION})


async def refuse_http(send: Send) -> None:
    """Answer 401 with a JSON body, without reading the request."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(REFUSED)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": REFUSED})
