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
- `calculator` (max_turns 4): the model may call a calculator by writing a line
  `calc: <expression>` (numbers, + - * / ** % and parentheses); the environment answers
  `result: <value>` (or `error: ...`) as a user message and the turn earns 0. A turn with
  no such line is the final answer, scored by the verifier, and ends the episode.

`HTTPEnvironment` speaks the same two calls to a server (docs/rl/environments.md):
`POST {url}/reset` with `{"row"}` answers `{"messages"}`; `POST {url}/step` with
`{"row", "messages", "completion"}` answers `{"reward", "observation", "done"}`.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Score = Callable[[dict[str, Any], str], float]
Messages = list[dict[str, str]]


class EpisodeFailed(Exception):
    """The environment broke one episode (raised, hung, or answered nonsense)."""


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
_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> float | int:
    """The value of an arithmetic expression (no names, no calls; exponents up to 100)."""

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported: {ast.dump(node)[:40]}")

    return value(ast.parse(expression, mode="eval").body)  # type: ignore[no-any-return]


class calculator(single_turn):
    """A calculator the model calls with a `calc:` line (see the module docstring)."""

    def step(self, messages: Messages, completion: str) -> tuple[float, Messages | None, bool]:
        call = _CALL.search(completion)
        if call is None:
            return float(self.score(self.row, completion)), None, True
        try:
            result = calculate(call.group(1))
            answer = f"result: {int(result) if float(result).is_integer() else result}"
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError) as exc:
            answer = f"error: {exc}"
        return 0.0, [{"role": "user", "content": answer}], False


@dataclass(frozen=True)
class BuiltIn:
    factory: Callable[..., Any]
    max_turns: int


BUILT_IN: dict[str, BuiltIn] = {
    "single_turn": BuiltIn(single_turn, 1),
    "retry": BuiltIn(retry, 2),
    "calculator": BuiltIn(calculator, 4),
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
        return answer.get("messages") if isinstance(answer, dict) else answer

    async def step(self, messages: Messages, completion: str) -> Any:
        return await self._post(
            "step", {"row": self.row, "messages": messages, "completion": completion}
        )
