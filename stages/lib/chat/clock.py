"""The run's date in chat templates: every rendering of a run reads one day, not the clock.

Input: a tokenizer, chat messages, and the run's date (`PIPE_DATE`, ISO, set by the engine
for a stage and the processes it starts: `engine.plan.dated`). Output: `render(...)`, the
template's text as `apply_chat_template` renders it with the clock at that day's midnight,
and `fixed_template(template, day)`, the template with each `strftime_now('<format>')`
replaced by that day's text (also what a vLLM server started by a stage is given).

Templates that read the date (Llama 3.2 and later: `strftime_now("%d %b %Y")` in the system
header) would otherwise render the day they run on: collect, rl, train and evaluate, or a
resume after midnight, would each see a different prompt. A call whose format is not a
string literal cannot be fixed this way and renders the clock (a warning says so).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from datetime import date, datetime
from typing import Any

from engine.stage import DATE_ENV
from stages.lib.chat.jinja import string_literal

_CALL = re.compile(r"""strftime_now\(\s*(?:"([^"\\]*)"|'([^'\\]*)')\s*\)""")
_LEFT = re.compile(r"strftime_now\s*\(")
log = logging.getLogger("pipe.chat")
_warned: set[str] = set()


def run_date() -> date | None:
    """The run's date, None outside a run (the clock decides, as transformers does)."""
    value = os.environ.get(DATE_ENV, "")
    try:
        return date.fromisoformat(value) if value else None
    except ValueError:
        return None


def fixed_template(template: str, day: date) -> str:
    """`template` with every `strftime_now('<format>')` replaced by `day`'s text."""
    moment = datetime(day.year, day.month, day.day)
    fixed = _CALL.sub(
        lambda m: string_literal(moment.strftime(m.group(1) or m.group(2) or "")), template
    )
    if _LEFT.search(fixed) and template not in _warned:
        _warned.add(template)
        log.warning(
            "the chat template calls strftime_now with a computed format: it renders the clock"
        )
    return fixed


def template_for(tokenizer: Any, day: date | None = None) -> str | None:
    """The tokenizer's chat template fixed to the run's date; None where it does not read the
    date (or there is no run date): `apply_chat_template` renders its own."""
    day = day or run_date()
    template = getattr(tokenizer, "chat_template", None)
    if day is None or not isinstance(template, str) or "strftime_now" not in template:
        return None
    return fixed_template(template, day)


def dated(ctx: Any) -> dict[str, str]:
    """`{"date": <the run's date>}` for a stage's `settings.json`, empty outside a run."""
    return {"date": ctx.date} if getattr(ctx, "date", "") else {}


def render(tokenizer: Any, messages: Sequence[dict[str, Any]], **options: Any) -> str:
    """`apply_chat_template(messages, tokenize=False, **options)`, the date the run's; tool
    calls' arguments given to the template as objects, as templates read them (OpenAI's
    messages carry them as JSON strings: `stages.lib.chat.tool_calls.template_messages`)."""
    template = template_for(tokenizer)
    if template is not None:
        options["chat_template"] = template
    if options.get("tools"):
        from stages.lib.chat.tool_template import require_tools

        require_tools(options.get("chat_template") or getattr(tokenizer, "chat_template", None))
    shown = list(messages)
    if any(m.get("tool_calls") for m in shown):
        from stages.lib.chat.tool_calls import template_messages

        shown = template_messages(shown)
    return str(tokenizer.apply_chat_template(shown, tokenize=False, **options))
