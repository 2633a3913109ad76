"""Python text written into a Jinja template.

Input: a string. Output: `string_literal(text)`, a Jinja string literal that renders as
`text`, for the templates the stages write (`plain`'s prompt template, a template fixed to the
run's date: `stages.lib.chat.clock`).

Jinja reads a string literal's escapes as Python's (`unicode-escape`) after turning each raw
carriage return in it into a newline, so the literal is JSON's: every quote, backslash and
control character escaped, `\\r` included; other characters kept as they are.
"""

from __future__ import annotations

import json


def string_literal(text: str) -> str:
    """`text` as a Jinja string literal (module docstring)."""
    return json.dumps(text, ensure_ascii=False)
