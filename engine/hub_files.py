"""What a model's snapshot folder must hold before a stage loads it, read as files.

Input: a snapshot folder of the Hugging Face cache (`snapshots/<sha>/`). Output: `missing(folder)`,
the files a checkpoint there lacks: `config.json`; the weights (`model.safetensors` or
`pytorch_model.bin`, or the shards of a sharded checkpoint); every shard its index
(`model.safetensors.index.json`, `pytorch_model.bin.index.json`) names; and the tokenizer
(`tokenizer.json`, `tokenizer.model`, `vocab.json` or `spiece.model`; not where the listing of
the commit's files huggingface_hub keeps shows the repository has none). Empty: complete.

Why: `hf download org/m config.json`, or loading the tokenizer alone, leaves a snapshot folder
for the commit that holds some files only; and another process's download fills its folder
file by file. A folder that exists is not a model that loads (`engine.hub.fetch` completes it
online, `engine.hub.pin` refuses it offline, naming what is missing).

Light: the standard library only; `pipe validate` reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re

INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
TOKENIZERS = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
# a shard of a sharded checkpoint: model-00001-of-00002.safetensors, pytorch_model-00001-of-...
SHARD = re.compile(r"^(?P<stem>.+)-\d{5}-of-\d{5}\.(?P<ext>safetensors|bin)$")


def missing(folder: str) -> list[str]:
    """The files the checkpoint in `folder` lacks (names relative to it), in a fixed order:
    config, weights (or the shards an index names), tokenizer."""
    have = set(_files(folder))
    out = [] if "config.json" in have else ["config.json"]
    index = next((i for i in INDEXES if i in have), None)
    if index is not None:
        shards = _shards(os.path.join(folder, index))
        out += [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
    elif not any(w in have for w in WEIGHTS):
        exts = sorted({m["ext"] for n in have if (m := SHARD.match(n))}, reverse=True)
        if exts:  # shards without the index that says which make the whole
            out.append(INDEXES[0] if exts[0] == "safetensors" else INDEXES[1])
        else:
            out.append(" or ".join(WEIGHTS))
    if not any(t in have for t in TOKENIZERS) and _listed(folder, TOKENIZERS) is not False:
        out.append(" or ".join(TOKENIZERS[:2]))
    return out


def _listed(folder: str, names: tuple[str, ...]) -> bool | None:
    """Whether the repository holds any of `names` at the snapshot's commit, as the listing of
    its files huggingface_hub keeps beside the snapshots says (`trees/<sha>.json`, written by a
    download through `snapshot_download`); None when there is no listing to read."""
    snapshot = os.path.normpath(folder)
    repo, sha = os.path.dirname(os.path.dirname(snapshot)), os.path.basename(snapshot)
    try:
        with open(os.path.join(repo, "trees", f"{sha}.json"), encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return any(n in files for n in names)


def _files(folder: str) -> list[str]:
    """The files directly in `folder` (a cache's snapshot entries are links to its blobs: a
    link whose blob is gone counts as missing)."""
    with contextlib.suppress(OSError):
        return [e.name for e in os.scandir(folder) if os.path.isfile(e.path)]
    return []


def _shards(index: str) -> list[str]:
    """The shard files an index's `weight_map` names, sorted; none when it cannot be read (the
    cache renames a file into place whole, so that is no download under way: the load says
    what is wrong with it)."""
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map") or {}
        return sorted({str(v) for v in weight_map.values()})
    except (OSError, ValueError, AttributeError):
        return []
