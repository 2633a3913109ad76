"""Token ids a checkpoint's conventions fix: where an answer ends, what stops generation, what pads.

Input: a Hugging Face tokenizer (with its chat template), and where there is one the model's
`config` and `generation_config`. Output: `answer_end(tokenizer) -> AnswerEnd` (the text the
chat template writes after an assistant turn's content, the closing token ids trained, the
rest), `eos_ids(tokenizer, model_config, generation_config) -> list[int]` (every id that ends
an answer; `checkpoint_eos_ids(model_dir, tokenizer)` reads the configs from a folder) and
`pad_id(tokenizer, config) -> int`; `answer_text(tokenizer, ids)`, an answer's text as a
tool-call parser reads it. Every stage that reads such an id reads
it here: `eos_token_id` may be an int or a list, `pad_token_id` may be missing, and a base
tokenizer's `eos_token` (`<|endoftext|>`) need not be what its template closes a turn with
(`<|im_end|>`). Nothing heavy is imported.

The end of an answer is what the chat template puts after an assistant turn: ChatML
`<|im_end|>\\n`, Llama 3 `<|eot_id|>`, Gemma `<end_of_turn>\\n`, Mistral `</s>`, the tiny
model's `<|eos|>`. Its tokens up to and including the last special token (the closing token:
`<|im_end|>`, `<end_of_turn>`) are trained and stop generation; what follows it (ChatML's and
Gemma's `\\n`) is template text the model never needs to write, since generation stops at the
closing token: it is kept out of the loss, left off the end of a trained sequence, and kept, outside
the loss, where the conversation goes on (`stages.lib.chat.turns`), so a multi-turn sequence
is the template's rendering token for token. TRL's SFT with
`assistant_only_loss` trains what the template's `{% generation %}` tags enclose (the
separator too, where the template puts it inside); OpenRLHF appends `eos_token` to the
answer, which for a base tokenizer is not the token the template closes a turn with. Here
the template decides, without needing generation tags, and the trailing separator is never
trained.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from stages.lib.chat.clock import render

_SENTINEL = "PIPEANSWERSENTINEL7"
_CACHE: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], AnswerEnd]] = (
    weakref.WeakKeyDictionary()
)


@dataclass(frozen=True)
class AnswerEnd:
    """What the chat template writes after an assistant turn's content."""

    text: str  # all of it (ChatML: "<|im_end|>\n")
    ids: tuple[int, ...]  # its tokens up to the last special one: trained, ending generation
    rest: str  # the text after those ("\n"): rendered, never trained

    @property
    def stop_id(self) -> int | None:
        """The closing token (the template's end-of-turn token), None if there is none."""
        return self.ids[-1] if self.ids else None


def answer_end(tokenizer: Any) -> AnswerEnd:
    """The template's end of an assistant turn (module docstring), cached per tokenizer;
    without a template that renders one, the tokenizer's `eos_token`."""
    key = (
        getattr(tokenizer, "chat_template", None),
        getattr(tokenizer, "eos_token", None),
        getattr(tokenizer, "bos_token", None),
    )
    try:
        cached = _CACHE.get(tokenizer)
    except TypeError:  # not weakly referable: computed each time
        cached = None
    if cached is not None and cached[0] == key:
        return cached[1]
    end = _answer_end(tokenizer)
    with contextlib.suppress(TypeError):  # not weakly referable: not cached
        _CACHE[tokenizer] = (key, end)
    return end


def _rendered_end(tokenizer: Any) -> str | None:
    """The text after an assistant turn's content in the template's rendering, None where
    there is no template or it does not render the turn."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": _SENTINEL},
    ]
    try:
        text = render(tokenizer, messages)
    except Exception:  # a template that refuses the probe conversation: eos_token decides
        return None
    at = text.rfind(_SENTINEL)
    return text[at + len(_SENTINEL) :] if at >= 0 else None


def _special_ids(tokenizer: Any) -> set[int]:
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", None) or ()}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i, tok in added.items() if getattr(tok, "special", False))
    return ids


def _answer_end(tokenizer: Any) -> AnswerEnd:
    text = _rendered_end(tokenizer)
    if not text:
        text = str(getattr(tokenizer, "eos_token", None) or "")
    if not text:
        return AnswerEnd("", (), "")
    ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    specials = _special_ids(tokenizer)
    last = max((k for k, t in enumerate(ids) if t in specials), default=None)
    if last is None:  # no special token: the whole text is the closing
        return AnswerEnd(text, tuple(ids), "")
    token = str(tokenizer.convert_ids_to_tokens(ids[last]))
    at = text.rfind(token)
    rest = text[at + len(token) :] if at >= 0 else ""
    return AnswerEnd(text, tuple(ids[: last + 1]), rest)


# special tokens a tool-call format is written with (Mistral's, v0.3 on): an answer's text keeps
# them, as vLLM's mistral tool parser asks of its server (`skip_special_tokens: false`)
TOOL_MARKERS = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")


def tool_marker_ids(tokenizer: Any) -> set[int]:
    """The ids of `tokenizer`'s special tokens that are tool-call markers (`TOOL_MARKERS`)."""
    return {
        i
        for i in _special_ids(tokenizer)
        if str(tokenizer.convert_ids_to_tokens(i)) in TOOL_MARKERS
    }


def answer_text(tokenizer: Any, ids: Sequence[int]) -> str:
    """The text of an answer's `ids` without special tokens (its closing, padding), except
    the tool-call markers (`TOOL_MARKERS`), which are a call's syntax: decoding them away
    leaves `[{"name": ...}]`, which no parser can tell from text."""
    kept = tool_marker_ids(tokenizer) & set(ids)
    if not kept:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))
    out: list[str] = []
    part: list[int] = []
    for i in ids:
        if i in kept:
            out += [str(tokenizer.decode(part, skip_special_tokens=True))]
            out += [str(tokenizer.convert_ids_to_tokens(i))]
            part = []
        else:
            part.append(i)
    out.append(str(tokenizer.decode(part, skip_special_tokens=True)))
    return "".join(out)


def _ids(value: Any) -> list[int]:
    """A config's token id field as a list: an int, a list of them, or nothing."""
    if value is None:
        return []
    if isinstance(value, Iterable) and not isinstance(value, str | bytes):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def eos_ids(
    tokenizer: Any = None, model_config: Any = None, generation_config: Any = None
) -> list[int]:
    """Every id that ends an answer, first seen first: the tokenizer's `eos_token_id`, the
    config's and the generation_config's `eos_token_id` (an int or a list), and the chat
    template's end-of-turn token (`answer_end(tokenizer).stop_id`)."""
    found: list[int] = []
    sources = [
        getattr(tokenizer, "eos_token_id", None),
        getattr(model_config, "eos_token_id", None),
        getattr(generation_config, "eos_token_id", None),
    ]
    if tokenizer is not None:
        sources.append(answer_end(tokenizer).stop_id)
    for source in sources:
        for i in _ids(source):
            if i not in found:
                found.append(i)
    return found


def checkpoint_eos_ids(model_dir: str, tokenizer: Any) -> list[int]:
    """`eos_ids` of a checkpoint folder: its tokenizer, and the `eos_token_id` of its
    `config.json` and `generation_config.json` read as JSON (either may be missing)."""
    fields = []
    for name in ("config.json", "generation_config.json"):
        try:
            data = json.loads((Path(model_dir) / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = {}
        fields.append(SimpleNamespace(eos_token_id=data.get("eos_token_id")))
    return eos_ids(tokenizer, *fields)


def pad_id(tokenizer: Any = None, config: Any = None) -> int:
    """The id that fills a batch's padding: the tokenizer's or the config's pad id, else
    the first end-of-sequence id (`eos_ids`), else 0.

    Any id in the vocabulary is safe: padding is told apart by the attention mask (or the
    packed position ids) and the loss mask, built from the sequences' lengths, never by
    comparing ids with this one, so a padded position is neither attended to nor trained
    on, and an end-of-sequence id standing in for a missing pad changes no result.
    """
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(config, "pad_token_id", None)):
        got = _ids(value)
        if got:
            return got[0]
    stops = eos_ids(tokenizer, config)
    return stops[0] if stops else 0
