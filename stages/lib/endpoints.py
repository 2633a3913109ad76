"""Where requests go: an HTTP endpoint for the `openai` and `vllm` backends.

Input: a backend block (and, for vllm, the GPUs the stage holds) and the
sampling settings. Output: an `Endpoint` (base URL, model name, endpoint mode,
API key) while a context is open, and `make_client`, the OpenAIClient for it.
For `vllm` the context starts vLLM's OpenAI server
(`stages.lib.vllm.server.vllm_server`) and stops it on exit, also on failure;
every row goes to its chat endpoint, so a prompt string gets the model's chat
template exactly as with the local backend and in training. That server requires a
secret made for this stage run (`stages.lib.vllm.auth`), which the endpoint carries as
its API key, so the client sends it as `Authorization: Bearer ...`; an `openai` backend
keeps the key its `api_key_env` names.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from stages.lib.api.client import OpenAIClient
from stages.lib.api.sampling import request_sampling
from stages.lib.config import OpenAIBackend, VLLMBackend

if TYPE_CHECKING:
    from stages.lib.config import Backend


class RequestSettings(Protocol):
    """The settings a request is sent with (collect's and evaluate's configs have them)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def max_output_tokens(self) -> int: ...
    @property
    def timeout_s(self) -> float: ...


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server to send requests to."""

    base_url: str
    model: str
    endpoint: str
    api_key: str | None = None
    vllm: bool = False  # a vLLM server the stage started: it takes vLLM's sampling fields

    def __repr__(self) -> str:  # the key never reaches a log line
        return f"Endpoint({self.base_url!r}, model={self.model!r}, endpoint={self.endpoint!r})"


def api_key(backend: OpenAIBackend) -> str | None:
    """The API key from the environment variable the config names (None if none named)."""
    if not backend.api_key_env:
        return None
    key = os.environ.get(backend.api_key_env)
    if key is None:
        raise ValueError(
            f"backend.api_key_env names '{backend.api_key_env}', "
            "which is not set in the environment"
        )
    return key


@contextmanager
def http_endpoint(
    backend: Backend,
    *,
    gpus: int,
    log: logging.Logger,
    log_file: str | None = None,
    devices: Sequence[str] | None = None,
) -> Iterator[Endpoint]:
    """The endpoint of an openai or vllm backend, open for the duration of the block.

    For vllm, `log_file` receives the server's output; several engines give a
    comma-separated base URL, which the client spreads prompts over.
    """
    if isinstance(backend, OpenAIBackend):
        yield Endpoint(backend.base_url, backend.model, backend.endpoint, api_key(backend))
    elif isinstance(backend, VLLMBackend):
        from stages.lib.vllm.auth import new_secret
        from stages.lib.vllm.server import vllm_server

        secret = new_secret()  # this stage run's: the server refuses requests without it
        with vllm_server(
            backend, gpus=gpus, log=log, log_file=log_file, devices=devices, secret=secret
        ) as base_url:
            log.info("vLLM server ready at %s", base_url)
            yield Endpoint(base_url, str(backend.model), "chat", api_key=secret, vllm=True)
    else:
        raise ValueError(f"backend kind '{backend.kind}' has no HTTP endpoint")


def make_client(cfg: RequestSettings, endpoint: Endpoint, connections: int) -> OpenAIClient:
    """The client for `endpoint` with the config's sampling settings and timeout: every
    sampling field the server takes (`stages.lib.api.sampling`), the config's temperature and
    top_p, the rest neutral."""
    sampling = {
        **request_sampling(cfg.temperature, cfg.top_p, vllm=endpoint.vllm),
        "max_tokens": cfg.max_output_tokens,
    }
    return OpenAIClient(
        endpoint.base_url,
        endpoint.model,
        endpoint=endpoint.endpoint,
        sampling=sampling,
        timeout_s=cfg.timeout_s,
        api_key=endpoint.api_key,
        connections=connections,
    )
