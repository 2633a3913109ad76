"""A verifiers taskset served over pipe's HTTP environment protocol, from verifiers' own venv.

    .venv-verifiers/bin/python stages/lib/env/verifiers_bridge.py --env-id my_tasks \
        [--config '{"n": 8}'] [--dump N]

Input: a verifiers 0.4.0 taskset id (a module or an installed package exporting one
`verifiers.v1.Taskset` subclass in `__all__`, resolved by verifiers' own loader) and keyword
arguments for its config. Output: an HTTP server on 127.0.0.1 at a free port, which prints
`ready <port>` on stdout once it listens; or with `--dump N` the taskset's first N tasks as
JSONL rows (the task data pipe's collect, evaluate and rl read as their input), then exits.

pipe drives the turns, so its engines keep their token ids; this process plays verifiers'
single-agent harness around them (docs/rl/verifiers.md), stateless, every call carrying the
row and the conversation (docs/rl/environments.md, "Served over HTTP"):

- `POST /reset {"row"}`: the task is built from the row (its fields validated as the task's
  data type); answers the opening (the task's `system_prompt`, then its `prompt`) and the
  tools of the task's and the taskset's toolsets (their `@vf.tool` methods as OpenAI
  function schemas).
- `POST /step {"row", "messages", "message"}`: the model's turn. Tool calls are run here (the
  toolset's method, in this process) and answered with `tool` messages, reward 0; the
  episode goes on unless one of the task's `@vf.stop` predicates over the trace says stop. A
  turn without tool calls ends the episode (as verifiers' harness does); at the end the
  task's rewards, metrics and judges score the trace (`Task.score`) and the reward is the
  trace's weighted sum.

Imports only the standard library and verifiers (with its dependencies): it runs in
`.venv-verifiers`, never in pipe's venv.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def load_taskset(env_id: str, config: dict[str, Any]) -> Any:
    """The taskset `env_id` built with `config` (its config class's fields)."""
    from verifiers.v1.configs.taskset import TasksetConfig
    from verifiers.v1.taskset import Taskset
    from verifiers.v1.utils.generic import concrete_type
    from verifiers.v1.utils.loaders import taskset_class

    cls = taskset_class(env_id)
    config_cls = concrete_type(cls, TasksetConfig, origin=Taskset) or TasksetConfig
    return cls(config_cls.model_validate({**config, "id": env_id}))


class Bridge:
    """The taskset's tasks as pipe environments: reset, step, score (module docstring)."""

    def __init__(self, taskset: Any) -> None:
        self.taskset = taskset
        self.task_cls = type(taskset).task_type()
        self.data_cls = self.task_cls.data_type()
        config_cls = self.task_cls.config_type()
        self.task_config = taskset.config.task
        if not isinstance(self.task_config, config_cls):  # the taskset's config left it generic
            self.task_config = config_cls.model_validate(self.task_config.model_dump())
        shared = list(type(taskset).toolsets(taskset.config))
        self.tools: dict[str, Any] = {}
        for toolset in shared + list(self.task_cls.toolsets(self.task_config)):
            self.tools.update(_toolset_functions(toolset))

    def task(self, row: dict[str, Any]) -> Any:
        fields = self.data_cls.model_fields
        extra = self.data_cls.model_config.get("extra") == "allow"
        data = {k: v for k, v in row.items() if k in fields or extra}
        return self.task_cls(self.data_cls.model_validate(data), self.task_config)

    def reset(self, row: dict[str, Any]) -> dict[str, Any]:
        data = self.task(row).data
        messages: list[dict[str, Any]] = []
        if data.system_prompt:
            messages.append({"role": "system", "content": data.system_prompt})
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        elif data.prompt:
            messages += [m.model_dump(exclude_none=True) for m in data.prompt]
        if not messages:
            raise ValueError("the task has no prompt and no system prompt")
        out: dict[str, Any] = {"messages": messages}
        if self.tools:
            out["tools"] = [_schema(name, fn) for name, fn in self.tools.items()]
        return out

    def step(self, body: dict[str, Any]) -> dict[str, Any]:
        task = self.task(body["row"])
        message = dict(body["message"])
        conversation = [*body["messages"], message]
        calls = message.get("tool_calls") or []
        if calls:
            observation = [self._answer(call) for call in calls]
            trace = _trace(task, [*conversation, *observation], self.tools)
            if not asyncio.run(_stopped(task, trace)):
                return {"reward": 0.0, "observation": observation, "done": False}
        else:
            trace = _trace(task, conversation, self.tools)
        asyncio.run(task.score(trace))
        return {
            "reward": float(trace.reward),
            "observation": None,
            "done": True,
            "rewards": {k: (None if r is None else r.value) for k, r in trace.rewards.items()},
            "metrics": dict(trace.metrics),
        }

    def _answer(self, call: dict[str, Any]) -> dict[str, Any]:
        function = call.get("function") or {}
        name, raw = function.get("name"), function.get("arguments") or "{}"
        try:
            fn = self.tools[str(name)]
            arguments = json.loads(raw) if isinstance(raw, str) else dict(raw)
            result = fn(**arguments)
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
            content = result if isinstance(result, str) else json.dumps(result, default=str)
        except KeyError:
            content = f"error: no tool named {name!r} (tools: {', '.join(self.tools)})"
        except Exception as exc:  # the tool's own error: the model reads it, the episode goes on
            content = f"error: {type(exc).__name__}: {exc}"
        return {"role": "tool", "tool_call_id": call.get("id", ""), "content": content}


async def _awaited(value: Any) -> Any:
    return await value


def _toolset_functions(toolset: Any) -> dict[str, Any]:
    from verifiers.v1.utils.decorators import discover_decorated

    found = discover_decorated(toolset, "tool")
    return {getattr(fn, "tool_name", None) or fn.__name__: fn for fn in found}


def _schema(name: str, fn: Any) -> dict[str, Any]:
    """An OpenAI function schema from the tool's signature and docstring (pydantic)."""
    from pydantic import create_model

    fields: dict[str, Any] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotation = Any if param.annotation is param.empty else param.annotation
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (annotation, default)
    arguments: Any = create_model(f"{name}_args", **fields)
    parameters: dict[str, Any] = arguments.model_json_schema()
    parameters.pop("title", None)
    for prop in parameters.get("properties", {}).values():
        prop.pop("title", None)
    description = (fn.__doc__ or "").strip()
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def _trace(task: Any, messages: list[dict[str, Any]], tools: dict[str, Any]) -> Any:
    """The conversation as a verifiers Trace, one path of message nodes; the assistant
    turns are the sampled ones."""
    from pydantic import TypeAdapter
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    from verifiers.v1.types import Message

    adapter: TypeAdapter[Any] = TypeAdapter(Message)
    nodes = []
    for i, raw in enumerate(messages):
        message = adapter.validate_python(_verifiers_message(raw))
        nodes.append(
            MessageNode(
                parent=i - 1 if i else None,
                message=message,
                sampled=raw is not None and raw.get("role") == "assistant",
            )
        )
    trace = Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=AgentInfo(config=AgentConfig()),
        nodes=nodes,
    )
    trace.is_completed = trace.ok = True
    return trace


def _verifiers_message(raw: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message in verifiers' shape (tool calls flat: id, name, arguments)."""
    out = {k: v for k, v in raw.items() if k in ("role", "content", "tool_call_id", "name")}
    if raw.get("role") == "assistant" and raw.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c.get("id", ""),
                "name": (c.get("function") or {}).get("name", ""),
                "arguments": _text((c.get("function") or {}).get("arguments", "")),
            }
            for c in raw["tool_calls"]
        ]
    if out.get("content") is None and raw.get("role") != "assistant":
        out["content"] = ""
    return out


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


async def _stopped(task: Any, trace: Any) -> bool:
    """Whether one of the task's `@vf.stop` predicates over the trace says stop."""
    for fn in task.hooks("stop"):
        try:
            result = fn(trace)
        except TypeError:  # a predicate over a Request or Response: not at this boundary
            continue
        if inspect.isawaitable(result):
            result = await result
        if result:
            trace.stop_condition = fn.__name__
            return True
    return False


def _handler(bridge: Bridge) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if self.path.rstrip("/") == "/reset":
                    answer = bridge.reset(body["row"])
                elif self.path.rstrip("/") == "/step":
                    answer = bridge.step(body)
                else:
                    return self._send(404, {"error": f"no route {self.path}"})
            except Exception as exc:  # the episode fails with the reason; the server stays up
                return self._send(500, {"error": f"{type(exc).__name__}: {exc}"})
            self._send(200, answer)

        def _send(self, status: int, answer: Any) -> None:
            data = json.dumps(answer, default=str).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def _exit_with_parent() -> None:
    """Stop when the process that started this one is gone (a killed stage)."""
    parent = os.getppid()

    def watch() -> None:
        import time

        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="bridge-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--env-id", required=True)
    args.add_argument("--config", default="{}", help="the taskset config's fields, as JSON")
    args.add_argument("--dump", type=int, default=None, help="print N tasks as JSONL and exit")
    parsed = args.parse_args(argv)
    taskset = load_taskset(parsed.env_id, json.loads(parsed.config))
    if parsed.dump is not None:
        for task in taskset.take(parsed.dump):
            print(json.dumps(task.data.model_dump(mode="json", exclude_defaults=True)))
        return 0
    bridge = Bridge(taskset)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(bridge))
    _exit_with_parent()
    print(f"ready {server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
