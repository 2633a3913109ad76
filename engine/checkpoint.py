"""A checkpoint folder read light: its chat template, as transformers finds it.

Input: a local checkpoint folder (a Hugging Face layout: `tokenizer_config.json`,
`chat_template.jinja`, ...). Output: `shown(path)`, a checkpoint's path as messages show it;
`chat_template(folder)`: what `tokenizer.chat_template`
is once transformers has loaded that folder (one Jinja text, `{name: text}` where the
checkpoint has named templates, or None for a base model); read as files, no transformers.

The one reader for the plan (`engine.plan.dated`: does a template read the date?) and the
stages (`stages.lib.chat.template`: is there a template at all?).
"""

from __future__ import annotations

import json
import os
from typing import Any

TEMPLATE_FILE = "chat_template.jinja"  # transformers' CHAT_TEMPLATE_FILE
NAMED_TEMPLATES = "additional_chat_templates"  # transformers' CHAT_TEMPLATE_DIR: <name>.jinja
CONFIG_FILES = ("tokenizer_config.json", "chat_template.json")  # a processor's legacy file last


def chat_template(folder: str) -> str | dict[str, str] | None:
    """The chat template of a checkpoint folder, None where it has none.

    As transformers 5 reads it: the template files win over the config (`chat_template.jinja`,
    the default one; `additional_chat_templates/<name>.jinja`, named ones), one text when only
    the default is there, `{name: text}` otherwise; without them, the `chat_template` of
    `tokenizer_config.json` (a text, or named templates `[{name, template}]`), else of a
    processor's `chat_template.json`. An empty template is none."""
    files = _named(os.path.join(folder, NAMED_TEMPLATES))
    default = _read(os.path.join(folder, TEMPLATE_FILE))
    if default is not None:
        files = {"default": default, **files}
    if files:
        return (files["default"] or None) if list(files) == ["default"] else files
    for name in CONFIG_FILES:
        template = _from_config(os.path.join(folder, name))
        if template:
            return template
    return None


def _read(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def _from_config(path: str) -> str | dict[str, str] | None:
    """A JSON file's `chat_template`: a text, or named templates as `{name: text}`."""
    try:
        with open(path, encoding="utf-8") as f:
            template: Any = json.load(f).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(template, list):  # named templates: [{name, template}]
        return {
            str(t.get("name")): str(t.get("template", "")) for t in template if isinstance(t, dict)
        }
    return template if isinstance(template, (str, dict)) else None


def _named(folder: str) -> dict[str, str]:
    if not os.path.isdir(folder):
        return {}
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jinja"):
            out[name.removesuffix(".jinja")] = _read(os.path.join(folder, name)) or ""
    return out


def shown(path: str) -> str:
    """A resolved path as `pipe plan` prints it: relative to the working directory when
    under it."""
    if not path.startswith("/"):
        return path
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel
