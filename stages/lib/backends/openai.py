"""The `openai` backend: any running OpenAI-compatible endpoint, named by its URL and model.

Input: the block (`base_url`, `model`, `api_key_env`, `endpoint`). Output: its rules (the
model is the name the server knows: no checkpoint, no hub id, prompts rendered by the server;
an environment's conversations need the chat endpoint) and its endpoint: the URL as given,
with the key read from the environment variable the block names (never written anywhere).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from stages.lib.backends.protocol import BackendConfig

if TYPE_CHECKING:
    from stages.lib.backends.endpoint import Endpoint, Serving


class OpenAIBackend(BackendConfig):
    """Any running OpenAI-compatible endpoint."""

    SERVES_OWN_MODEL = True
    VLLM_SAMPLING = False  # an OpenAI server: OpenAI's sampling fields only

    kind: Literal["openai"] = Field(
        description="Send requests to a running OpenAI-compatible server."
    )
    base_url: str = Field(description="The server's base URL, e.g. http://127.0.0.1:8000/v1.")
    model: str = Field(description="The model name the server expects in each request.")
    api_key_env: str | None = Field(
        None,
        description="Name of the environment variable holding the API key; the key is never "
        "written anywhere.",
    )
    endpoint: Literal["chat", "completions"] = Field(
        "chat",
        description="chat: /v1/chat/completions with messages; completions: /v1/completions with a "
        "prompt.",
    )

    def served_elsewhere(self) -> str | None:
        if self.endpoint == "completions":
            return "an openai backend's completions endpoint gets each prompt as written"
        return "an openai backend's server renders prompts with its own chat template"

    def conversation_problem(self) -> tuple[str, str] | None:
        if self.endpoint == "chat":
            return None
        return (
            "backend.endpoint",
            "an environment's episodes are conversations, sent to the chat endpoint: "
            f"set it to 'chat', found '{self.endpoint}'",
        )

    @contextmanager
    def open_endpoint(self, serving: Serving) -> Iterator[Endpoint]:
        from stages.lib.backends.endpoint import Endpoint

        yield Endpoint(self.base_url, self.model, self.endpoint, api_key(self))


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
