"""The run's secret in front of every vLLM server: the middleware as an ASGI app (no vLLM
needed), and how the server is started with it (command line, environment)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest

from stages.lib.backends.vllm import auth as vllm_auth
from stages.lib.backends.vllm import process as vllm_process
from stages.lib.backends.vllm import server as vllm_server
from stages.lib.backends.vllm.backend import VLLMBackend
from tests.conftest import ROOT

SECRET = "s3cret-" + "x" * 36
GUARDED = ["/v1/completions", "/v1/models", "/collective_rpc", "/sleep", "/reset_prefix_cache"]
REFUSED_BODY = {"error": "Unauthorized: this server requires the run's secret"}


async def _inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """vLLM's app, as far as these tests need: 200 and the path it served."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.accept"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": scope["path"].encode()})


def call(path: str, *headers: tuple[bytes, bytes], kind: str = "http") -> list[dict[str, Any]]:
    """The messages the middleware (secret SECRET) sends for one request to `path`."""
    app = vllm_auth.RequireSecret(_inner)
    scope = {"type": kind, "method": "POST", "path": path, "headers": list(headers)}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


@pytest.fixture(autouse=True)
def server_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_auth.SECRET_ENV, SECRET)


def auth(value: str) -> tuple[bytes, bytes]:
    return (b"authorization", value.encode())


@pytest.mark.parametrize("path", [*GUARDED, "/health", "/wake_up", "/metrics", "/"])
@pytest.mark.parametrize(
    "headers",
    [(), (auth("Bearer wrong"),), (auth(f"Basic {SECRET}"),), (auth(f"Bearer {SECRET}x"),)],
    ids=["none", "wrong", "basic", "longer"],
)
def test_refused_without_the_secret(path: str, headers: tuple[tuple[bytes, bytes], ...]) -> None:
    start, body = call(path, *headers)
    assert start == {
        "type": "http.response.start",
        "status": 401,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body["body"])).encode()),
            (b"www-authenticate", b"Bearer"),
        ],
    }
    assert json.loads(body["body"]) == REFUSED_BODY


@pytest.mark.parametrize("path", [*GUARDED, "/health"])
def test_the_secret_passes_through(path: str) -> None:
    start, body = call(path, auth(f"Bearer {SECRET}"))
    assert (start["status"], body["body"]) == (200, path.encode())


def test_header_name_and_scheme_are_case_insensitive() -> None:
    start, _ = call("/collective_rpc", (b"Authorization", f"bearer {SECRET}".encode()))
    assert start["status"] == 200


def test_two_authorization_headers_are_refused() -> None:
    start, _ = call("/sleep", auth(f"Bearer {SECRET}"), auth("Bearer other"))
    assert start["status"] == 401


def test_websocket_without_the_secret_is_closed_before_accept() -> None:
    assert call("/v1/realtime", kind="websocket") == [{"type": "websocket.close", "code": 1008}]
    assert call("/v1/realtime", auth(f"Bearer {SECRET}"), kind="websocket") == [
        {"type": "websocket.accept"}
    ]


def test_lifespan_events_reach_the_app() -> None:
    seen: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    asyncio.run(vllm_auth.RequireSecret(app)({"type": "lifespan"}, None, None))  # type: ignore[arg-type]
    assert seen == ["lifespan"]


def test_a_server_without_a_secret_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_auth.SECRET_ENV)
    with pytest.raises(RuntimeError) as err:
        vllm_auth.RequireSecret(_inner)
    assert str(err.value) == "PIPE_VLLM_SECRET is not set: refusing to serve without a secret"


def test_secrets_are_fresh_and_travel_as_a_bearer_header() -> None:
    one, two = vllm_auth.new_secret(), vllm_auth.new_secret()
    assert one != two and len(one) == len(two) == 43  # 32 random bytes, URL-safe base64
    assert vllm_auth.bearer(one) == {"Authorization": f"Bearer {one}"}


def test_importable_by_vllms_interpreter_with_the_standard_library_only() -> None:
    """`-S`: no site-packages, as in vLLM's venv, which has none of ours; the server's
    PYTHONPATH is what `server_env` sets."""
    env = vllm_server.server_env(VLLMBackend(kind="vllm"), devices=[], secret=SECRET, base={})
    code = "import stages.lib.backends.vllm.auth as a, sys; print(a.MIDDLEWARE, sorted(set(sys.modules) & {'pydantic', 'stages.lib.config'}))"
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "stages.lib.backends.vllm.auth.RequireSecret []"


def test_the_server_gets_the_middleware_on_its_command_line_and_the_secret_in_its_env() -> None:
    backend = VLLMBackend(kind="vllm", model="m")
    cmd = vllm_server.server_command(backend, python="py", port=8001, gpus=0, host="10.0.0.7")
    assert cmd[cmd.index("--host") : cmd.index("--host") + 6] == [
        "--host", "10.0.0.7", "--port", "8001", "--middleware", "stages.lib.backends.vllm.auth.RequireSecret",
    ]  # fmt: skip
    assert not any(SECRET in part for part in cmd)
    env = vllm_server.server_env(
        backend, devices=[], secret=SECRET, base={"PYTHONPATH": "/elsewhere"}
    )
    assert env["PIPE_VLLM_SECRET"] == SECRET
    assert env["PYTHONPATH"] == f"{ROOT}:/elsewhere"
    with pytest.raises(ValueError) as err:
        vllm_server.server_env(backend, devices=[], secret="", base={})
    assert (
        str(err.value) == "a vLLM server needs a secret (stages.lib.backends.vllm.auth.new_secret)"
    )


@pytest.mark.parametrize(
    ("host", "origin"), [("127.0.0.1", "http://127.0.0.1:8001"), ("::1", "http://[::1]:8001")]
)
def test_urls_name_the_bound_host(host: str, origin: str) -> None:
    server = vllm_process.ServerProcess(None, 8001, ROOT / "v.log", host)  # type: ignore[arg-type]
    assert (server.origin, server.url) == (origin, f"{origin}/v1")
