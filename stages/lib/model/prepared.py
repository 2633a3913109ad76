"""A stage's models as folders it can load: a GGUF converted, the stage's chat template applied.

Input: a model path as the resolved config holds it (a checkpoint folder or a `.gguf` file),
the dtype the stage computes in, the Jinja text of its `chat_template:` setting (None: the
checkpoint's own) and the run folder.
Output: `prepare_model(...) -> folder`: the path itself when there is nothing to do; a GGUF's
converted checkpoint (`stages.lib.model.gguf.converted`, kept per content hash and dtype); with
a template, a view of the folder in `<run-dir>/.pipe-models/template-<key>/`: every file of
the checkpoint linked, and its `tokenizer_config.json` holding the template (a
`chat_template.jinja` left out, since transformers would prefer it). Every loader
(`AutoTokenizer`, vLLM's server) then renders the stage's template with no option to pass,
and a checkpoint the stage saves copies that `tokenizer_config.json` (`stages.lib.model.save`):
the template a stage trained with travels with what it trained.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from typing import Any

from engine.gguf_header import is_gguf
from stages.lib.chat.template import template_text
from stages.lib.model.gguf import MODELS_DIR, converted

DROPPED = ("tokenizer_config.json", "chat_template.jinja", "chat_template.json")


def stage_template(cfg: Any) -> str | None:
    """The Jinja text of a config's `chat_template:` (with its `prompt_template`), None unset."""
    setting = getattr(cfg, "chat_template", None)
    return template_text(setting, getattr(cfg, "prompt_template", None)) if setting else None


def compute_dtype(bf16: bool) -> str:
    """The dtype a GGUF is converted in for a trainer: the one it computes in."""
    return "bfloat16" if bf16 else "float32"


def prepare_model(
    path: str,
    *,
    run_dir: str,
    dtype: str,
    template: str | None,
    log: logging.Logger | None = None,
) -> str:
    """The folder a stage loads for `path` (module docstring); `log`: the stage's."""
    folder = converted(path, dtype, run_dir, log) if is_gguf(path) else path
    return templated(folder, template, run_dir) if template is not None else folder


def templated(folder: str, template: str, run_dir: str) -> str:
    """A view of checkpoint `folder` whose tokenizer renders `template` (module docstring);
    one per (folder, its files, its tokenizer_config, template), made once."""
    folder = os.path.abspath(folder)
    names = sorted(os.listdir(folder))
    config: dict[str, Any] = {}
    path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    key = json.dumps([folder, names, config, template], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    out = f"{run_dir.rstrip('/')}/{MODELS_DIR}/template-{digest}"
    if os.path.isfile(os.path.join(out, "tokenizer_config.json")):
        return out
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in names:
        if name not in DROPPED:
            os.symlink(os.path.join(folder, name), os.path.join(tmp, name))
    with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({**config, "chat_template": template}, f, indent=2, ensure_ascii=False)
        f.write("\n")
    try:
        os.replace(tmp, out)
    except OSError:  # another task made it first: the same view
        shutil.rmtree(tmp, ignore_errors=True)
    return out
