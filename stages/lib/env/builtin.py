"""The built-in environments, and the client of one served over HTTP.

Input: the stage's verifier (`score(row, completion) -> float`) and the block's `config`
options. Output: one environment per episode (`stages.lib.env.contract` holds the contract).

- `single_turn`: the opening is the row's prompt (its `messages`, or its `prompt` as one
  user message); the one turn's reward is the verifier's score and the episode ends. Every
  stage runs this when no environment is named: the verifiers are its one-turn case.
- `retry` (max_turns 2): as `single_turn`, but an answer the verifier does not score as
  correct (1.0) earns `-penalty` and gets `feedback` back as a user message, and the model
  answers again. A correct answer at any turn earns 1.0, so an episode solved at the
  first turn totals 1.0, at the second 1.0 - penalty, and never solved -penalty per turn.
- `calculator` (max_turns 4): offers the function tool `calculator` (`{"expression"}`:
  numbers, + - * / ** % and parentheses). The model calls it as its chat template writes
  tool calls; each call is answered by a `tool` message, `result: <value>` (or
  `error: ...`), and the turn earns 0. With a template that has no tool-call format (the
  tiny models' plain one) the model calls it by writing a line `calc: <expression>`,
  answered by a user message. A turn with no call is the final answer, scored by the
  verifier, and ends the episode.
- `python` (max_turns 4): offers the function tool `python` (`{"code"}`), run in the
  sandbox (`stages.lib.env.sandbox`); each call is answered by a `tool` message with what
  the program printed (or its error). With a template that has no tool-call format, a
  fenced ```python block is the call, answered by a user message. Otherwise as `calculator`.

`HTTPEnvironment` speaks the same two calls to a server (docs/rl/environments.md):
`POST {url}/reset` with `{"row"}` answers `{"messages"}` (and optionally `"tools"`);
`POST {url}/step` with `{"row", "messages", "completion", "message"}` (`message`: the
assistant message with its `tool_calls`) answers `{"reward", "observation", "done"}`, the
observation OpenAI messages (`tool` messages with their `tool_call_id` included).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from stages.lib.env.messages import EpisodeFailed, Messages

Score = Callable[[dict[str, Any], str], float]


def opening(row: dict[str, Any]) -> Messages:
    """The row's prompt as chat messages (`messages`, or `prompt` as one user message)."""
    if isinstance(row.get("messages"), list):
        return [dict(m) for m in row["messages"]]
    if isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
    raise EpisodeFailed("the row has neither 'messages' nor a string 'prompt'")


class single_turn:
    """The verifier as a one-turn environment."""

    def __init__(self, score: Score) -> None:
        self.score = score
        self.row: dict[str, Any] = {}

    def reset(self, row: dict[str, Any]) -> Messages:
        self.row = row
        return opening(row)

    def step(self, messages: Messages, completion: str) -> tuple[float, Messages | None, bool]:
        return float(self.score(self.row, completion)), None, True


class retry(single_turn):
    """A wrong answer is told so and answers again (see the module docstring)."""

    def __init__(
        self, score: Score, penalty: float = 0.5, feedback: str = "wrong, try again"
    ) -> None:
        super().__init__(score)
        self.penalty, self.feedback = float(penalty), str(feedback)

    def step(self, messages: Messages, completion: str) -> tuple[float, Messages | None, bool]:
        if self.score(self.row, completion) >= 1.0:
            return 1.0, None, True
        return -self.penalty, [{"role": "user", "content": self.feedback}], False


_CALL = re.compile(r"^\s*calc:\s*(.+?)\s*$", re.MULTILINE)
_BLOCK = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)


class with_tools(single_turn):
    """A one-answer task with tools: the model's tool calls are answered by `tool` messages
    (`stages.lib.env.tools.answer_calls`) and the turn earns 0; a call that did not parse is
    told so as a user message (the model's mistake: the episode goes on); a turn with no
    call is the final answer, scored by the verifier. `text_call(completion)` is the
    built-in's convention for a template with no tool-call format (None: no call)."""

    offers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, score: Score) -> None:
        from stages.lib.env.tools import TOOLS

        super().__init__(score)
        self.tools = [TOOLS[name].schema for name in self.offers]

    def step(self, messages: Messages, completion: str) -> tuple[float, Messages | None, bool]:
        from stages.lib.env.tools import answer_calls

        calls = getattr(completion, "tool_calls", [])
        if calls:
            return 0.0, answer_calls(calls, self.offers, self.run_tool), False
        error = getattr(completion, "parse_error", None)
        if error is not None:
            return 0.0, [{"role": "user", "content": f"error: your tool call: {error}"}], False
        answer = self.text_call(completion)
        if answer is None:
            return float(self.score(self.row, completion)), None, True
        return 0.0, [{"role": "user", "content": answer}], False

    def text_call(self, completion: str) -> str | None:
        return None

    def run_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """The answer to a call of the offered tool `name` (the built-in tool's)."""
        from stages.lib.env.tools import TOOLS

        return TOOLS[name].run(arguments)


class calculator(with_tools):
    """The function tool `calculator`; with a template that has no tool-call format, a
    `calc: <expression>` line (module docstring)."""

    offers = ("calculator",)

    def text_call(self, completion: str) -> str | None:
        from stages.lib.env.tools import calculator_text

        call = _CALL.search(completion)
        return None if call is None else calculator_text(call.group(1))


@dataclass(frozen=True)
class BuiltIn:
    factory: Callable[..., Any]
    max_turns: int


class python(with_tools):
    """The function tool `python`, run in the sandbox with the block's `config` as its
    limits (`stages.lib.env.sandbox.Limits`: cpu_s, wall_s, memory_mb, processes,
    output_bytes, file_mb); with a template that has no tool-call format, a fenced
    ```python block (module docstring)."""

    offers = ("python",)

    def __init__(self, score: Score, **limits: Any) -> None:
        from stages.lib.env.sandbox import Limits

        super().__init__(score)
        self.limits = Limits(**limits)

    def run_tool(self, name: str, arguments: dict[str, Any]) -> str:
        from stages.lib.env.tools import call_python_tool

        return call_python_tool(arguments, self.limits)

    def text_call(self, completion: str) -> str | None:
        from stages.lib.env.sandbox import run_python
        from stages.lib.env.tools import tool_text

        block = _BLOCK.search(completion)
        return None if block is None else tool_text(run_python(block.group(1), self.limits))


BUILT_IN: dict[str, BuiltIn] = {
    "single_turn": BuiltIn(single_turn, 1),
    "retry": BuiltIn(retry, 2),
    "calculator": BuiltIn(calculator, 4),
    "python": BuiltIn(python, 4),
}


class HTTPEnvironment:
    """An environment served elsewhere: each call is one JSON POST (module docstring)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url, self.timeout_s = url, timeout_s
        self.row: dict[str, Any] = {}

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(f"{self.url}/{path}", json=body) as response,
        ):
            if response.status != 200:
                text = (await response.text())[:200]
                raise EpisodeFailed(f"{self.url}/{path} answered HTTP {response.status}: {text}")
            return await response.json()

    async def reset(self, row: dict[str, Any]) -> Any:
        self.row = row
        answer = await self._post("reset", {"row": row})
        if isinstance(answer, dict) and answer.get("tools"):
            return {"messages": answer.get("messages"), "tools": answer["tools"]}
        return answer.get("messages") if isinstance(answer, dict) else answer

    async def step(self, messages: Messages, completion: str) -> Any:
        message = getattr(completion, "message", {"role": "assistant", "content": completion})
        body = {"row": self.row, "messages": messages, "completion": str(completion)}
        return await self._post("step", {**body, "message": message})
