"""NeMo Gym's rows and results as pipe's episodes: OpenAI's Responses API items read as chat
messages.

Input: a NeMo Gym row (`responses_create_params` with its `input` and `tools`, plus the
fields its resources server verifies with) and the stage's sampling; the JSON an agent's
`/run` returns (the Responses object: `function_call`, `function_call_output`, `message` and
`reasoning` items, `usage`; and `reward`, `failure_kind`, `failure_reason`, `mask_sample`).
Output: the body to post (`run_body`), the client that posts it (`AgentClient`), and
`AgentEpisode` (what `/run` returned, as an
episode: the conversation as chat messages, the tools in chat form, the reward, the turns and
each turn's token ids where the model server returned them).

The stage's sampling (temperature, top_p, max_output_tokens) replaces a row's own: what the
stage's config says is what every request carries, as with pipe's own environments. The
conversion follows OpenAI's two APIs: a `message` item and the `function_call` items after it
make one assistant message with `tool_calls` (`call_id` as the call's id, `arguments` the
JSON string), a `function_call_output` a `tool` message, `developer` a `system` message; a
`reasoning` item's text goes to the assistant message's `reasoning_content`.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from stages.lib.api.client import RequestError, complete_retrying, post_json

MAX_RETRIES, BACKOFF_S = 4, 0.5  # a run's retries on a transient failure, and the first wait
FULL_REWARD = 1.0
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def run_body(row: dict[str, Any], sampling: dict[str, Any]) -> bytes:
    """The row as the agent's `/run` takes it, the stage's sampling in its
    `responses_create_params` (ValueError for a row NeMo Gym cannot run)."""
    params = row.get("responses_create_params")
    if not isinstance(params, dict) or "input" not in params:
        raise ValueError("a NeMo Gym row needs 'responses_create_params' with its 'input'")
    return json.dumps(
        {**row, "responses_create_params": {**params, **sampling}}, ensure_ascii=False
    ).encode()


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses tools (`{type: function, name, parameters, ...}`) in chat form
    (`{type: function, function: {name, description, parameters}}`); others as they are."""
    if not isinstance(tools, list) or not tools:
        return None
    out = []
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "function" and "name" in tool:
            function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            out.append({"type": "function", "function": function})
        else:
            out.append(tool)
    return out


def _text(content: Any) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def input_messages(params: dict[str, Any]) -> list[dict[str, Any]]:
    """The opening conversation of `responses_create_params` (`instructions` first)."""
    out: list[dict[str, Any]] = []
    if isinstance(params.get("instructions"), str):
        out.append({"role": "system", "content": params["instructions"]})
    given = params.get("input")
    if isinstance(given, str):
        return [*out, {"role": "user", "content": given}]
    out += _items(given if isinstance(given, list) else [])[0]
    return out


def _items(items: list[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Responses items as chat messages, and each model turn's token ids (those the model
    server added: `prompt_token_ids`, `generation_token_ids`, `generation_log_probs`)."""
    messages: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    open_turn: dict[str, Any] | None = None  # the assistant message calls still join

    def assistant() -> dict[str, Any]:
        nonlocal open_turn
        if open_turn is None:
            open_turn = {"role": "assistant", "content": ""}
            messages.append(open_turn)
        return open_turn

    for item in items:
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        ids = {k: item[k] for k in TOKEN_FIELDS if item.get(k) is not None}
        if ids:
            turns.append(ids)
        if kind == "reasoning":
            parts = item.get("summary") or item.get("content") or []
            assistant()["reasoning_content"] = _text(parts)
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            open_turn = None
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": _text(item.get("output")),
                }
            )
        elif kind == "message" and item.get("role", "assistant") == "assistant":
            if open_turn is not None and (open_turn["content"] or open_turn.get("tool_calls")):
                open_turn = None  # a new model turn
            assistant()["content"] = _text(item.get("content"))
        elif kind == "message":
            open_turn = None
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text(item.get("content"))})
    return messages, turns


@dataclass
class AgentEpisode:
    """What one `/run` returned, as an episode."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    reward: float
    turns: int
    error: str | None = None  # the agent's failure_kind: failure_reason
    mask_sample: bool = False
    usage: tuple[int, int] = (0, 0)
    token_turns: list[dict[str, Any]] = field(default_factory=list)

    # what a report reads of an episode, as of `stages.lib.env.contract.Episode`: the agent
    # rewards the episode once, at its end
    @property
    def rewards(self) -> list[float]:
        return [self.reward]

    @property
    def total(self) -> float:
        return self.reward

    @property
    def solved(self) -> bool:
        return self.reward >= FULL_REWARD

    @property
    def first_turn_solved(self) -> bool:
        return self.solved and self.turns == 1

    def record(self) -> dict[str, Any]:
        """The fields an episode line holds, as pipe's own environments' episodes write them
        (`stages.lib.env.contract.Episode.record`), plus `mask_sample`."""
        out: dict[str, Any] = {"messages": self.messages}
        if self.tools:
            out["tools"] = self.tools
        out.update(
            rewards=self.rewards,
            total_reward=self.reward,
            turns=self.turns,
            solved=self.solved,
            end="failed" if self.error else "done",
        )
        if self.error:
            out["error"] = self.error
        if self.mask_sample:
            out["mask_sample"] = True
        return out


def agent_episode(row: dict[str, Any], result: Any) -> AgentEpisode:
    """The episode of a `/run` result (ValueError for JSON that is not one)."""
    try:
        response = result["response"]
        reward = float(result["reward"])
        items = response["output"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the agent's answer is not a run result ({exc!r})") from exc
    params = row.get("responses_create_params") or {}
    said, token_turns = _items(items if isinstance(items, list) else [])
    usage = response.get("usage") or {}
    failure = result.get("failure_kind")
    return AgentEpisode(
        messages=[*input_messages(params), *said],
        tools=chat_tools(params.get("tools")),
        reward=reward,
        turns=sum(m["role"] == "assistant" for m in said),
        error=f"{failure}: {result.get('failure_reason')}" if failure else None,
        mask_sample=bool(result.get("mask_sample")),
        usage=(int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)),
        token_turns=token_turns,
    )


def failed_episode(row: dict[str, Any], reason: str) -> AgentEpisode:
    """An episode whose `/run` failed for good (its reason), with the row's opening."""
    params = row.get("responses_create_params") or {}
    opening = input_messages(params) if isinstance(params, dict) else []
    tools = chat_tools(params.get("tools")) if isinstance(params, dict) else None
    return AgentEpisode(opening, tools, 0.0, 0, error=reason)


class AgentClient:
    """Posts rows to an agent's `/run` (the collector's client: `complete` one request)."""

    def __init__(self, timeout_s: float, connections: int) -> None:
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.connections = connections
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AgentClient:
        connector = aiohttp.TCPConnector(limit=self.connections, limit_per_host=0)
        headers = {"Content-Type": "application/json"}
        self.session = aiohttp.ClientSession(connector=connector, headers=headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    async def complete(self, url: str, body: bytes) -> Any:
        """One `/run`: its JSON (RequestError for an HTTP error or a body that is not JSON)."""
        assert self.session is not None
        return await post_json(self.session, url, body, self.timeout)


async def run_all(
    url: str,
    rows: list[dict[str, Any]],
    samples: int,
    sampling: dict[str, Any],
    concurrency: int,
    timeout_s: float,
) -> list[AgentEpisode]:
    """Every row's `samples` episodes, row after row, each one `/run` at `url` (`concurrency`
    at once, retried on a transient failure); a run that fails for good, or answers what is
    not a run result, fails its episode with the reason."""
    gate = asyncio.Semaphore(concurrency)
    client = AgentClient(timeout_s, concurrency)

    async def one(row: dict[str, Any]) -> AgentEpisode:
        try:
            body = run_body(row, sampling)
            out = await complete_retrying(client, url, body, gate, MAX_RETRIES, BACKOFF_S)
            return agent_episode(row, out)
        except (RequestError, ValueError) as exc:
            return failed_episode(row, str(exc))

    async with client:
        return await asyncio.gather(*(one(r) for r in rows for _ in range(samples)))
