"""The `python` built-in environment and tool: the model runs code in the sandbox.

Input: the stage's verifier (`score(row, completion) -> float`) and the sandbox's limits
(`stages.lib.env.sandbox.Limits` fields as options). Output: one environment per episode,
in the text contract of `stages.lib.env.builtin` (`reset(row)`, `step(messages, completion)`),
and the tool as OpenAI function-calling speaks it (`python_tool_schema`, `call_python_tool`).

- A turn whose answer holds a fenced ```python block runs the first such block in the
  sandbox and answers with what it printed (or its error) as a user message; the turn
  earns 0. A turn without one is the final answer, scored by the verifier.
"""

from __future__ import annotations

import re
from typing import Any

from stages.lib.env.builtin import Messages, Score, single_turn
from stages.lib.env.sandbox import Limits, Result, run_python

_BLOCK = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)


def python_tool_schema() -> dict[str, Any]:
    """The `python` tool as an OpenAI function schema."""
    return {
        "type": "function",
        "function": {
            "name": "python",
            "description": (
                "Run a Python program in a fresh sandbox (no network, a temporary folder, "
                "limited time and memory) and return what it printed."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "code": {"type": "string", "description": "The program; print the results."}
                },
                "required": ["code"],
            },
        },
    }


def tool_text(result: Result) -> str:
    """What the model reads back: stdout, then the error or traceback's last lines."""
    text = result.stdout
    if result.error is not None:
        text += f"error: {result.error} (the run was stopped)"
    elif result.exit_code != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-3:])
        text += f"error: exit code {result.exit_code}\n{tail}"
    return text if text.strip() else "(no output)"


def call_python_tool(arguments: dict[str, Any], limits: Limits | None = None) -> str:
    """The text a `tool` message carries for a call `python({"code": ...})`."""
    code = arguments.get("code") if isinstance(arguments, dict) else None
    if not isinstance(code, str):
        return "error: the python tool takes {'code': '<program>'}"
    return tool_text(run_python(code, limits or Limits()))


class python_env(single_turn):
    """The model runs ```python blocks in the sandbox (see the module docstring)."""

    def __init__(self, score: Score, **limits: Any) -> None:
        super().__init__(score)
        self.limits = Limits(**limits)

    def step(self, messages: Messages, completion: str) -> tuple[float, Messages | None, bool]:
        block = _BLOCK.search(completion)
        if block is None:
            return float(self.score(self.row, completion)), None, True
        answer = tool_text(run_python(block.group(1), self.limits))
        return 0.0, [{"role": "user", "content": answer}], False
