"""A stage's `chat_template:` setting: which template renders its prompts, and the plan-time
refusal of a checkpoint that has none.

Input: the setting (a family name, `plain` with a `prompt_template`, or a Jinja file: an
absolute path once resolved) and the checkpoints the stage renders prompts for (folders, GGUF
files, an earlier stage's output, a model built from a spec).
Output: `template_text(setting, prompt_template) -> str` (the Jinja text the stage's tokenizer
gets), `checkpoint_template(path)` (a checkpoint's own template, read light: its
`chat_template.jinja` or `tokenizer_config.json`, a GGUF's `tokenizer.chat_template`) and
`check_chat_template(...)` (located diagnostics for `pipe validate`). Light: no torch.

A base checkpoint (google/gemma-3-270m, Qwen2.5-0.5B, any pretrained release) has no chat
template, and transformers refuses to render one at run time. Here a stage that renders
prompts with such a checkpoint names its template or is refused at validate:

- a family name (`chatml`, `gemma`, `llama3`, `mistral`): the release's template, verbatim
  (`stages/lib/chat/families/`); its turn markers should be tokens of the vocabulary
  (Gemma's base vocabulary holds `<start_of_turn>`); `gemma_tools` and `mistral_tools` render
  as `gemma` and `mistral` do and also render tools (`stages.lib.chat.tool_template`);
- `plain` with a `prompt_template` such as `"Question: {prompt}\\nAnswer:"` (OpenRLHF's
  `--input_template`, DeepSeek-R1-Zero's habit): the tokenizer's BOS (when it has one), each
  user turn written through the prompt template (a system message as its own line before it),
  each answer followed by the EOS token, which is where an answer ends;
- a Jinja file (relative to the pipeline's folder).

The setting applies to every checkpoint the stage renders for (evaluate's checkpoints
alike: one rendering, compared like with like) and takes the place of a checkpoint's own
template. The template a stage trained with is written into its output checkpoint's
`tokenizer_config.json` (`stages.lib.model.prepared`), so later stages, and vLLM serving it,
render the same text without naming it again.

Every kind that renders prompts declares the two settings with their types here,
`ChatTemplate` and `PromptTemplate` (each its type and help text), empty by default.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from engine.checkpoint import chat_template, shown
from engine.errors import Diagnostic, did_you_mean
from engine.gguf_header import NotGGUF, is_gguf, read_header
from engine.stage import ResolveContext
from stages.lib.chat.jinja import string_literal

RELEASES = ("chatml", "gemma", "llama3", "mistral")  # each a release's template, verbatim
FAMILIES = (*RELEASES, "gemma_tools", "mistral_tools")  # and two that also render tools
TEMPLATES = Path(__file__).resolve().parent / "families"  # each family's template
PLAIN = "plain"
SLOT = "{prompt}"
CHAT_TEMPLATE_HELP = (
    "The chat template prompts are rendered with, in place of the checkpoint's own: a family "
    "(chatml, gemma, llama3, mistral), plain (with prompt_template; an answer ends at eos), or a "
    "Jinja file. Needed for a checkpoint without one (a base model); written into the "
    "checkpoint this stage saves."
)
PROMPT_TEMPLATE_HELP = (
    "With chat_template plain: the text around each user turn, '{prompt}' standing for it, "
    "e.g. 'Question: {prompt}\\nAnswer:'."
)
ChatTemplate = Annotated[str | None, Field(description=CHAT_TEMPLATE_HELP)]
PromptTemplate = Annotated[str | None, Field(description=PROMPT_TEMPLATE_HELP)]
EXAMPLE = '"Question: {prompt}\\nAnswer:"'
CHOICES = f"a family ({', '.join(RELEASES)}), {PLAIN} with a prompt_template such as {EXAMPLE}"


def plain_template(prompt_template: str) -> str:
    """The Jinja text of `plain` (module docstring) around `prompt_template`."""
    before, _, after = (string_literal(part) for part in prompt_template.partition(SLOT))
    return (
        "{% if bos_token %}{{ bos_token }}{% endif %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
        "{% elif message['role'] == 'system' %}{{ message['content'] + '\\n' }}"
        f"{{% else %}}{{{{ {before} + message['content'] + {after} }}}}"
        "{% endif %}{% endfor %}"
    )


def template_text(setting: str, prompt_template: str | None = None) -> str:
    """The Jinja text the setting names (checked at validate: `check_chat_template`)."""
    if setting == PLAIN:
        if prompt_template is None:
            raise ValueError("chat_template plain needs a prompt_template")
        return plain_template(prompt_template)
    if setting in FAMILIES:
        return (TEMPLATES / f"{setting}.jinja").read_text(encoding="utf-8")
    with open(setting, encoding="utf-8") as f:
        return f.read()


def checkpoint_template(path: str) -> str | None:
    """The chat template a checkpoint folder or GGUF file carries, None when it has none."""
    if is_gguf(path):
        return read_header(path).chat_template
    template = chat_template(path)  # as transformers finds it
    return template if template is None or isinstance(template, str) else json.dumps(template)


TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


def _has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def _setting_errors(
    ctx: ResolveContext, setting: str | None, prompt_template: str | None
) -> list[Diagnostic]:
    if setting is None or setting == PLAIN:
        if setting is None and prompt_template is not None:
            msg = "a prompt_template acts only with chat_template plain: set chat_template: plain"
            return [ctx.error("prompt_template", msg)]
        if setting == PLAIN and prompt_template is None:
            msg = f"chat_template plain needs a prompt_template, such as {EXAMPLE}"
            return [ctx.error("chat_template", msg)]
        if prompt_template is not None and prompt_template.count(SLOT) != 1:
            found = prompt_template.count(SLOT)
            msg = f"'{SLOT}' must stand once for the user's turn, found {found} times"
            return [ctx.error("prompt_template", msg)]
        return []
    errors = []
    if prompt_template is not None:
        msg = f"a prompt_template acts only with chat_template plain, found '{setting}'"
        errors.append(ctx.error("prompt_template", msg))
    if setting in FAMILIES or os.path.isfile(setting):
        return errors
    hint = did_you_mean(os.path.basename(setting), [*FAMILIES, PLAIN])
    return [
        *errors,
        ctx.error(
            "chat_template",
            f"'{setting}' is neither {CHOICES}, nor a Jinja file{hint}",
        ),
    ]


def check_chat_template(
    ctx: ResolveContext,
    setting: str | None,
    prompt_template: str | None,
    models: Sequence[tuple[str, Any]],
    renders: str | None = None,
) -> list[Diagnostic]:
    """The setting itself, and every checkpoint of `models` ((field, value) pairs) that has
    no template of its own while the stage names none, located at that checkpoint's field.
    `renders`, when given, says why the stage renders nothing itself (an openai backend's
    server renders with its own template): then any setting acts on nothing."""
    if renders is not None:
        return [
            ctx.error(path, f"{renders}: {path} acts on nothing here; leave it out")
            for path, value in (("chat_template", setting), ("prompt_template", prompt_template))
            if value is not None
        ]
    errors = _setting_errors(ctx, setting, prompt_template)
    if setting is not None:
        return errors
    for field, value in models:
        if not isinstance(value, str) or ctx.is_produced(value) or "://" in value:
            continue  # built from a spec (templated), made by an earlier stage, or remote
        if not (os.path.isfile(value) or _has_tokenizer(value)):
            continue  # not a checkpoint with a tokenizer on disk: nothing renders from it
        try:
            has = checkpoint_template(value) is not None
        except (NotGGUF, OSError):
            continue  # `check_checkpoint` says what is wrong with the file
        if not has:
            errors.append(
                ctx.error(
                    field,
                    f"'{shown(value)}' has no chat template (a base model): set chat_template to "
                    f"{CHOICES}, or a Jinja file",
                )
            )
    return errors
