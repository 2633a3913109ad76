"""The `model:` block of the train and rl stages: a checkpoint path or a model built from config.

Input: the YAML value: a checkpoint folder (or `@stage`), a tiny model spec (`TinyModel`: the
project's own Llama and template), or a real family's test checkpoint (`FamilyModel`: its
architecture, special tokens, chat template and generation_config, random weights).
Output: the typed `ModelRef`; `stages.lib.model.path` checks a path at plan time.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Tag

from stages.lib.builders.recipe import FamilyModel, TinyModel


def _model_tag(value: Any) -> str:
    if isinstance(value, FamilyModel) or (isinstance(value, dict) and "family" in value):
        return "family_model"
    return "spec" if isinstance(value, dict | TinyModel) else "path"


ModelRef = Annotated[
    Annotated[str, Tag("path")]
    | Annotated[TinyModel, Tag("spec")]
    | Annotated[FamilyModel, Tag("family_model")],
    Discriminator(_model_tag),
]
