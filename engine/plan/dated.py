"""Plan, part of: the run's date, the one day chat templates that read the clock render,
fixed at plan.

Input: the pipeline's `date:` (None unset), the run folder, and a stage's resolved config.
Output: `run_date` -> (the day, where it came from): the `date:` setting, else the day kept
in the run folder by an unfinished run (`.pipe-date`: a resume after midnight renders the
prompts its first part rendered), else today; and `reads_date(config)` -> the model field
whose checkpoint's chat template calls `strftime_now` (Llama 3.2 and later), or None.

Templates that call `strftime_now` render the day they are rendered on, so a run's stages
would see different prompts across midnight. Every stage renders the run's date instead
(`StageContext.date`, `PIPE_DATE` for the processes it starts); a stage whose model's
template reads the date has that date in its cache key, and only such a stage: a key that
changed every day would re-run everything daily. A model made by an upstream stage is
not on disk at plan; its key follows from the upstream stage's key, which holds the date
when the upstream model's template reads it (templates pass through unchanged).
"""

from __future__ import annotations

import os
from datetime import date
from typing import Any

from engine.checkpoint import chat_template
from engine.fsio import atomic_write_text, exists, makedirs, read_text, remove

KEPT = ".pipe-date"  # in the run folder while a run is unfinished


def kept_path(run_dir: str) -> str:
    return f"{run_dir.rstrip('/')}/{KEPT}"


def run_date(setting: date | None, run_dir: str) -> tuple[date, str]:
    """The day the run's templates render, and where it came from."""
    if setting is not None:
        return setting, "date:"
    path = kept_path(run_dir)
    if exists(path):
        try:
            kept = date.fromisoformat(read_text(path).strip())
            return kept, f"kept by the unfinished run ({path})"
        except ValueError:
            pass
    return date.today(), "today"


def keep(run_dir: str, day: date) -> None:
    """Keep the run's date in its folder until every stage has completed."""
    makedirs(run_dir)
    atomic_write_text(kept_path(run_dir), f"{day.isoformat()}\n")


def release(run_dir: str) -> None:
    """Every stage completed: the next run plans its own date."""
    if exists(kept_path(run_dir)):
        remove(kept_path(run_dir))


def template_reads_date(folder: str) -> bool:
    """Whether a checkpoint folder's chat template (any of its named ones) calls `strftime_now`."""
    template = chat_template(folder)
    texts = [template] if isinstance(template, str) else list((template or {}).values())
    return any("strftime_now" in t for t in texts)


def _file_reads_date(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return "strftime_now" in f.read()
    except OSError:
        return False


def reads_date(config: Any) -> str | None:
    """The first of the config's `MODEL_INPUTS` whose checkpoint's template (or, for a
    `.jinja` file, whose own text) reads the date."""
    for field in type(config).MODEL_INPUTS:
        value: Any = config
        for part in field.split("."):
            value = getattr(value, part, None)
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, str) and os.path.isdir(v) and template_reads_date(v):
                return str(field)
            if isinstance(v, str) and v.endswith(".jinja") and _file_reads_date(v):
                return str(field)  # a stage's own template file (`chat_template:`)
    return None
