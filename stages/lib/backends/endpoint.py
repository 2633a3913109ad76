"""Where requests go: the HTTP endpoint a backend opens, and the client for it.

Input: an `Endpoint` (base URL, model name, endpoint mode, API key), which a backend's
`open_endpoint` yields while its block is open (`stages.lib.backends.protocol`: an `openai`
backend's URL and the key its `api_key_env` names; a `vllm` backend's servers, started for
the block, every row sent to their chat endpoint so a prompt string gets the model's chat
template exactly as with the local backend and in training, with this stage run's secret as
the key), and the sampling settings. Output: `make_client`, the OpenAIClient for it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from stages.lib.api.client import OpenAIClient
from stages.lib.api.sampling import request_sampling


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
class Serving:
    """Where a backend that starts servers runs them: the GPUs the stage holds (`devices`:
    their ids, CUDA_VISIBLE_DEVICES), the log its progress goes to and the file its servers'
    output goes to; `tool_call_parser`, the format the servers read the model's tool calls
    in (the environment's setting; None: the one the checkpoint's template shows); `device`,
    the torch device a backend that serves from the stage's own process loads on."""

    log: logging.Logger
    gpus: int = 0
    devices: Sequence[str] | None = None
    log_file: str | None = None
    tool_call_parser: str | None = None
    device: str = "cpu"


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server to send requests to."""

    base_url: str
    model: str
    endpoint: str
    api_key: str | None = None
    vllm: bool = False  # a vLLM server the stage started: it takes vLLM's sampling fields
    tokenizes: bool = False  # it answers /tokenize and returns token ids (vLLM's, pipe's own)

    def __repr__(self) -> str:  # the key never reaches a log line
        return f"Endpoint({self.base_url!r}, model={self.model!r}, endpoint={self.endpoint!r})"


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
