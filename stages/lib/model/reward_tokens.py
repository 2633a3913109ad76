"""What a reward model reads of a policy's answer: the policy's token ids, or its text.

Input: the policy's checkpoint (a folder, or a hub id the local cache holds) with the chat
template the stage renders with (its `chat_template:` setting's text, else the checkpoint's
own), and the reward model's checkpoint. Output: `reads(...) -> Reading | None`: `ids` where
the two share a tokenizer and a chat template (the policy's ids are what the reward model was
trained on), else `text` (the answer decoded, rendered with the reward model's chat template
and tokenized with its tokenizer, as TRL's GRPOTrainer scores with a reward model of its
own), each with why; where either has no tokenizer on disk yet (an earlier stage's output, a
model built from a spec, a GGUF file, a hub id not in the cache), which: the rl stage then
compares the folders it loads when it starts. Light: files read as JSON and bytes, no torch.

Two tokenizers are the same when their files say they tokenize alike: `tokenizer.json` (less
its padding and truncation), the vocabulary and merges files, a sentencepiece model, and
`tokenizer_config.json` and `special_tokens_map.json` less what does not change a token id
(the pad token, padding side, length bound, names, paths and where the files were loaded
from, the chat template, compared on its own).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from engine.checkpoint import chat_template
from stages.lib.model.path import local_folder

IDS, TEXT = "ids", "text"
VOCABULARY = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")
SETTINGS = ("tokenizer_config.json", "special_tokens_map.json")
UNREAD = {  # fields that change no token id
    "padding",
    "truncation",
    "pad_token",
    "padding_side",
    "model_max_length",
    "name_or_path",
    "tokenizer_file",
    "chat_template",
    "is_local",  # how transformers 5 found the files it saved
    "local_files_only",
}


@dataclass(frozen=True)
class Reading:
    """How the reward model reads an answer (`IDS` or `TEXT`), why, and what of the reward
    model differs from the policy (`TEXT`: "tokenizer (tokenizer.json)", "chat template")."""

    mode: str
    why: str
    differs: str = ""


def tokenizer_folder(value: Any) -> str | None:
    """`local_folder`, where it holds tokenizer files."""
    folder = local_folder(value)
    if folder is None or not any(os.path.isfile(os.path.join(folder, n)) for n in VOCABULARY):
        return None
    return folder


def _file(folder: str, name: str) -> Any:
    """What of file `name` decides token ids: parsed JSON less `UNREAD`, else its bytes."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    if not name.endswith(".json"):
        with open(path, "rb") as f:
            return f.read()
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError:
        return None
    return {k: v for k, v in data.items() if k not in UNREAD} if isinstance(data, dict) else data


def tokenizer_difference(policy: str, reward: str) -> str | None:
    """The first tokenizer file the two folders hold differently, None where none does."""
    for name in (*VOCABULARY, *SETTINGS):
        if _file(policy, name) != _file(reward, name):
            return name
    return None


def _template(folder: str) -> str | None:
    found = chat_template(folder)
    return found if found is None or isinstance(found, str) else json.dumps(found)


def compare(policy: str, template: str | None, reward: str) -> Reading:
    """How the reward model of folder `reward` reads the answers of the policy of folder
    `policy` rendered with `template` (None: its own)."""
    differs = tokenizer_difference(policy, reward)
    if differs is None and (template or _template(policy)) == _template(reward):
        why = "the reward model has the policy's tokenizer and chat template: the policy's ids"
        return Reading(IDS, why)
    what = f"tokenizer ({differs})" if differs else "chat template"
    why = (
        f"the reward model's {what} differs from the policy's: each answer decoded, rendered "
        "with the reward model's chat template and tokenized with its tokenizer (as TRL)"
    )
    return Reading(TEXT, why, what)


def reads(policy: Any, template: str | None, reward: Any) -> Reading | str:
    """`compare` where both checkpoints are on this machine with their tokenizers, else
    why not (module docstring)."""
    p, r = tokenizer_folder(policy), tokenizer_folder(reward)
    if p is not None and r is not None:
        return compare(p, template, r)
    missing = [name for name, f in (("the policy", p), ("the reward model", r)) if f is None]
    return f"{' and '.join(missing)} {'have' if len(missing) > 1 else 'has'} no tokenizer on disk"
