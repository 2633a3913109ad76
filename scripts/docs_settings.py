"""Write docs/reference/settings.md, every setting of a pipeline file, from the JSON Schema.

Input: schemas/pipeline.schema.json (`pipe schema --out schemas`, i.e. `make schemas`).
Output: docs/reference/settings.md: the top-level keys, a stage's keys, each stage kind's
settings and the blocks they use (name, type, default, description), in a fixed order, so
the same schema always gives the same page. `tests/unit/test_docs.py` fails when the
committed page differs from what this writes; `make docs-reference` rewrites it.

Each table sits between `<!-- settings:NAME -->` and `<!-- /settings:NAME -->` (NAME a kind,
a block such as `EnvironmentConfig`, `pipeline` for the top-level keys, `stage` for a
stage's), so another page includes it (MyST's `include` with `start-after`/`end-before`).

Standard library only: `python scripts/docs_settings.py [--check]`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "schemas" / "pipeline.schema.json"
PAGE = ROOT / "docs" / "reference" / "settings.md"
FIX = "make docs-reference"
# the built-in kinds in the order a pipeline runs them; a plugin's kinds follow, sorted
KIND_ORDER = ("dataset", "collect", "filter", "train", "evaluate", "rl")
PAGE_NAME = "settings.md"

Schema = dict[str, Any]


def ref_name(ref: str) -> str:
    """`#/$defs/VLLMBackend` -> `VLLMBackend`."""
    return ref.rsplit("/", 1)[-1]


def anchor(name: str) -> str:
    """The GitHub/MyST heading slug of a heading that is exactly `name`."""
    return re.sub(r"[^\w\- ]", "", name.lower().replace(" ", "-"))


def escape(text: str) -> str:
    """Markdown-escape a description for a table cell, code spans kept (a | in one escaped,
    as tables need)."""
    text = " ".join(text.split())
    parts = re.split(r"(`[^`]*`)", text)
    for i in range(0, len(parts), 2):
        part = re.sub(r"([\\*<>|])", r"\\\1", parts[i])
        # an underscore at a word's edge could open emphasis; inside a word it cannot
        parts[i] = re.sub(r"(?<!\w)_|_(?!\w)", r"\\_", part)
    for i in range(1, len(parts), 2):
        parts[i] = parts[i].replace("|", "\\|")  # a table's cell ends at a bare | even in code
    return "".join(parts)


def flow(value: Any) -> str:
    """A default as YAML flow text: null, true, 0.5, text, [a, b], {k: v}."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, str):
        return value if value and re.fullmatch(r"[\w./@:+-]+", value) else json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(flow(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {flow(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


BOUNDS = (
    ("exclusiveMinimum", ">"),
    ("minimum", ">="),
    ("exclusiveMaximum", "<"),
    ("maximum", "<="),
)


class Page:
    """The page's text, built from the schema's `$defs` in a fixed order."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.defs: dict[str, Schema] = schema["$defs"]
        self.kinds = kinds(self.defs)
        # the heading each block is described under (its anchor is the heading's slug)
        self.headings = {"StageSpec": "A stage", **{c: k for k, c in self.kinds.items()}}
        for name in self.defs:
            self.headings.setdefault(name, name)
        self.users = self._users()

    def _users(self) -> dict[str, list[str]]:
        """Block -> where it is used (`cluster.slurm`, collect's `backend`), in page order."""
        owners = {
            "StageSpec": ("", "stages.NAME."),
            **{c: (f"{k}'s ", "") for k, c in self.kinds.items()},
        }
        paths: dict[str, list[tuple[str, str]]] = {}

        def visit(definition: Schema, where: tuple[str, str]) -> None:
            for field, prop in sorted(definition.get("properties", {}).items()):
                for name in dict.fromkeys(refs_in(prop)):
                    if name in owners or (where[0], where[1] + field) in paths.get(name, ()):
                        continue
                    paths.setdefault(name, []).append((where[0], where[1] + field))
                    visit(self.defs[name], (where[0], where[1] + field + "."))

        visit(self.schema, ("", ""))
        for name, where in owners.items():
            visit(self.defs[name], where)
        return {name: [f"{who}`{path}`" for who, path in found] for name, found in paths.items()}

    def link(self, name: str) -> str:
        return f"[{name}]({PAGE_NAME}#{anchor(self.headings[name])})"

    def type_text(self, prop: Schema) -> str:
        """A property's type in words, each referenced block linked to its section."""
        if "$ref" in prop:
            return self.link(ref_name(prop["$ref"]))
        for key in ("anyOf", "oneOf"):
            if key in prop:
                options = [o for o in prop[key] if o.get("type") != "null"]
                text = " or ".join(self.type_text(o) for o in options)
                return text + (" or null" if len(options) < len(prop[key]) else "")
        if "const" in prop:
            return f"`{flow(prop['const'])}`"
        if "enum" in prop:
            return "one of " + ", ".join(f"`{flow(v)}`" for v in prop["enum"])
        kind = prop.get("type", "any")
        if kind == "array":
            items = prop.get("items")
            text = "list" + (f" of {self.type_text(items)}" if items else "")
        elif kind == "object":
            extra = prop.get("additionalProperties")
            text = f"mapping to {self.type_text(extra)}" if isinstance(extra, dict) else "mapping"
        else:
            text = kind if isinstance(kind, str) else " or ".join(kind)
        bounds = [f"{op} {flow(prop[key])}" for key, op in BOUNDS if key in prop]
        return text + (f" ({', '.join(bounds)})" if bounds else "")

    def table(self, definition: Schema) -> list[str]:
        """The settings of one object: name, type, default, description."""
        required = set(definition.get("required", ()))
        rows = ["| setting | type | default | description |", "|---|---|---|---|"]
        for name, prop in sorted(definition.get("properties", {}).items()):
            if name in required:
                default = "required"
            elif "default" in prop:
                default = f"`{flow(prop['default'])}`"
            else:
                default = ""
            description = escape(prop.get("description", ""))
            rows.append(f"| `{name}` | {self.type_text(prop)} | {default} | {description} |")
        return rows

    def order(self, start: list[str], seen: set[str]) -> list[str]:
        """Blocks reached from `start`, breadth first, each once, none already in `seen`."""
        order: list[str] = []
        queue = list(start)
        while queue:
            name = queue.pop(0)
            if name in seen or name not in self.defs:
                continue
            seen.add(name)
            order.append(name)
            queue += refs_in(self.defs[name].get("properties", {}))
        return order

    def block(self, name: str) -> list[str]:
        definition = self.defs[name]
        lines = [f"### {name}", ""]
        if definition.get("description"):
            lines += [escape(definition["description"]), ""]
        used = ", ".join(self.users.get(name, ()))
        if used:
            lines += [f"Used by {used}.", ""]
        table = [f"<!-- settings:{name} -->", *self.table(definition), f"<!-- /settings:{name} -->"]
        return [*lines, *table, ""]

    def render(self) -> str:
        defs, schema = self.defs, self.schema
        seen = {"StageSpec", *self.kinds.values()}
        lines = [
            "# Settings reference",
            "",
            "<!-- generated by scripts/docs_settings.py from schemas/pipeline.schema.json: do",
            f"     not edit; after a schema change run `{FIX}`"
            " (tests/unit/test_docs.py checks) -->",
            "",
            "Every key of a pipeline file, from the JSON Schema that `pipe schema` writes (the",
            "one your editor reads through the `$schema` line). A default is what a stage starts",
            "from before presets apply: `pipe plan --explain` shows the value a run gets, and",
            "where it came from.",
            "",
            "## The pipeline file",
            "",
        ]
        if schema.get("description"):
            lines += [escape(schema["description"]), ""]
        lines += [
            "<!-- settings:pipeline -->",
            *self.table(schema),
            "<!-- /settings:pipeline -->",
            "",
        ]
        for name in self.order(refs_in(schema.get("properties", {})), seen):
            lines += self.block(name)
        stage = defs["StageSpec"]
        lines += ["## A stage", "", "Each entry under `stages:`.", ""]
        lines += ["<!-- settings:stage -->", *self.table(stage), "<!-- /settings:stage -->", ""]
        for name in self.order(refs_in(stage.get("properties", {})), seen):
            lines += self.block(name)
        lines += ["## Stage kinds", "", "A stage's `config:`, by its `kind:`.", ""]
        for kind, name in self.kinds.items():
            definition = defs[name]
            lines += [f"### {kind}", ""]
            if definition.get("description"):
                lines += [f"{escape(definition['description'])} (`{name}`)", ""]
            table = self.table(definition)
            lines += [f"<!-- settings:{kind} -->", *table, f"<!-- /settings:{kind} -->", ""]
        start = [ref for name in self.kinds.values() for ref in refs_in(defs[name])]
        shared = self.order(start, seen)
        if shared:
            lines += ["## Blocks", "", "The nested blocks of the stage kinds' settings.", ""]
            for name in shared:
                lines += self.block(name)
        rest = sorted(set(defs) - seen)
        if rest:
            lines += ["## Other blocks", ""]
            for name in rest:
                lines += self.block(name)
        return "\n".join(lines).rstrip("\n") + "\n"


def refs_in(prop: Any) -> list[str]:
    """Names of the blocks a property refers to, in order."""
    found: list[str] = []
    if isinstance(prop, dict):
        if "$ref" in prop:
            found.append(ref_name(prop["$ref"]))
        for value in prop.values():
            found += refs_in(value)
    elif isinstance(prop, list):
        for value in prop:
            found += refs_in(value)
    return found


def kinds(defs: dict[str, Schema]) -> dict[str, str]:
    """Stage kind -> the name of its config block, from StageSpec's `if kind == ...` rules."""
    found: dict[str, str] = {}
    for rule in defs["StageSpec"].get("allOf", ()):
        kind = rule["if"]["properties"]["kind"]["const"]
        found[kind] = ref_name(rule["then"]["properties"]["config"]["$ref"])
    known = [k for k in KIND_ORDER if k in found]
    return {k: found[k] for k in known + sorted(set(found) - set(known))}


def render(schema: Schema) -> str:
    """The whole page, as text."""
    return Page(schema).render()


def generate(schema_path: Path = SCHEMA) -> str:
    return render(json.loads(schema_path.read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run `{FIX}`", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
