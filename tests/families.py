"""Test checkpoints of the four real families, built once per session.

A test that takes `family_checkpoint` calls it with a family's name (and `vocab="real"`
where it needs the released vocabulary) and gets the checkpoint's folder; parametrize over
`FAMILIES` to run a check on every family:

    @pytest.mark.parametrize("family", FAMILIES)
    def test_something(family_checkpoint, family):
        path = family_checkpoint(family)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

FAMILIES = ("chatml", "llama3", "gemma", "mistral")
SIZES = {"hidden_size": 32, "num_layers": 2, "num_heads": 4}


def real_vocab_missing(family: str) -> str | None:
    """Why the family's real vocabulary cannot be built here (None: it can)."""
    from stages.lib.builders.conventions import real_vocab_file

    try:
        real_vocab_file(family)
    except ValueError as e:
        return str(e)
    return None


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`family_checkpoint(family, vocab="small") -> Path`, each built once per session."""
    from stages.lib.builders.families import build_family_checkpoint

    built: dict[tuple[str, str], Path] = {}

    def get(family: str, vocab: str = "small") -> Path:
        if (family, vocab) not in built:
            if vocab == "real" and (why := real_vocab_missing(family)):
                pytest.skip(why)
            folder = tmp_path_factory.mktemp(f"{family}-{vocab}") / "checkpoint"
            built[family, vocab] = build_family_checkpoint(family, folder, vocab=vocab, **SIZES)  # type: ignore[arg-type]
        return built[family, vocab]

    return get


_LOADED: dict[Path, Any] = {}


def family_tokenizer(family_checkpoint: Callable[..., Path], family: str) -> Any:
    """The tokenizer of `family`'s checkpoint, `<family>-real` that of its release's vocabulary:
    loaded once per session then (a 262,144-token one takes seconds), so not to be changed."""
    from transformers import AutoTokenizer

    name, _, real = family.partition("-")
    path = family_checkpoint(name, vocab=real or "small")
    if not real:
        return AutoTokenizer.from_pretrained(path)
    if path not in _LOADED:
        _LOADED[path] = AutoTokenizer.from_pretrained(path)
    return _LOADED[path]
