"""The JSON Schema of a pipeline file, generated from the models.

Each stage's `config:` is typed by its kind through `if kind is K then config: KConfig`
branches, so an editor (yaml-language-server) completes and checks stage settings too.
"""

from __future__ import annotations

import json
from typing import Any

from engine.load.schema import PipelineSpec
from engine.stage import kinds

SCHEMA_FILE = "pipeline.schema.json"
_REF = "#/$defs/{model}"


def pipeline_schema() -> dict[str, Any]:
    """The pipeline file's JSON Schema (draft 2020-12)."""
    schema = PipelineSpec.model_json_schema(ref_template=_REF)
    defs: dict[str, Any] = schema.setdefault("$defs", {})
    branches = []
    for name, kind in sorted(kinds().items()):
        sub = kind.config.model_json_schema(ref_template=_REF)
        defs.update(sub.pop("$defs", {}))
        title = kind.config.__name__
        defs[title] = sub
        branches.append(
            {
                "if": {"properties": {"kind": {"const": name}}, "required": ["kind"]},
                "then": {"properties": {"config": {"$ref": f"#/$defs/{title}"}}},
            }
        )
    stage = defs["StageSpec"]
    stage["allOf"] = branches
    stage["properties"]["kind"]["examples"] = sorted(kinds())
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = SCHEMA_FILE
    return schema


def schema_text() -> str:
    """The schema as committed: sorted keys, two-space indent, trailing newline."""
    return json.dumps(pipeline_schema(), indent=2, sort_keys=True) + "\n"
