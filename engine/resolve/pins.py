"""Resolve, part of: hub ids pinned to a commit.

Input: a stage's validated config (its kind's `hub_inputs` hook: the fields that may name a
Hugging Face repository, and whether a model or a dataset), its `Draft`, and the `Pinning` of
the planning under way. Output: the draft's data rewritten in place, each hub id as
`org/name@<sha>` (so the config, its hash and the stage's cache key change when a branch
moves), the source of each value saying what was pinned and where the commit was read
(`pipe plan --explain`), the pins for the plan's record, and located errors.

`pipe plan` and `pipe run` ask the hub (`engine.hub.pin`: a short timeout; with
`HF_HUB_OFFLINE` the local cache only, which must hold a model whole: `engine.hub_files`);
`pipe validate` never does (`network` off): it pins from the local cache when it holds the
revision, refuses an id the cache lacks, or holds in part, when offline, and otherwise leaves
the id for the plan to pin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import Diagnostic
from engine.hub import HubError, HubId, Pin, hub_fields, pin
from engine.load.source import Document, get_at, set_at
from engine.resolve.types import Draft, Source


@dataclass
class Pinning:
    """The pins of one planning: whether the hub may be asked, and the commits read so far (the
    alternative plans made while planning, and a run's second plan, reuse them)."""

    network: bool = True
    made: dict[tuple[str, str, str], Pin] = field(default_factory=dict)

    def pin(self, hub: HubId, repo_type: str) -> Pin | None:
        key = (repo_type, hub.repo, hub.revision)
        if key not in self.made:
            got = pin(hub, repo_type, network=self.network)
            if got is None:
                return None
            self.made[key] = got
        return self.made[key]


@dataclass(frozen=True)
class Pinned:
    """One hub id of a stage's config, pinned: for the plan's record."""

    field: str
    written: str
    value: str
    source: str

    def as_dict(self) -> dict[str, str]:
        return {"written": self.written, "pinned": self.value, "from": self.source}


def pin_hub_inputs(
    config: Any, draft: Draft, view: Document, pinning: Pinning, errors: list[Diagnostic]
) -> list[Pinned]:
    """Pin the hub ids among the config's `hub_inputs` in `draft.merged`; what was pinned."""
    out: list[Pinned] = []
    for hf in hub_fields(config.hub_inputs(), lambda path: get_at(draft.merged, path)):
        pinned = hf.values
        for i, v, hub in hf.ids:
            where = hf.path + ((i,) if hf.many else ())
            try:
                got = pinning.pin(hub, hf.repo_type)
            except HubError as exc:
                folder = (
                    f"; nor is there a folder '{v}' next to the pipeline" if exc.unknown else ""
                )
                loc, dotted_at = view.value_loc(where), f"stages.{draft.name}.config.{hf.dotted}"
                errors.append(Diagnostic(loc, dotted_at, f"{exc}{folder}"))
                continue
            if got is None or hub.at(got.sha) == v:  # not cached at validate; or a sha written
                continue
            pinned[i] = hub.at(got.sha)
            out.append(Pinned(hf.dotted, v, pinned[i], got.source))
        if pinned != hf.values:
            set_at(draft.merged, hf.path, hf.rebuilt(pinned))
            _record(draft, hf.dotted, [p for p in out if p.field == hf.dotted])
    return out


def _record(draft: Draft, dotted: str, pins: list[Pinned]) -> None:
    src = draft.sources.get(dotted, Source("kind default"))
    said = "; ".join(
        f"{p.written} pinned to {p.value.rpartition('@')[2]} ({p.source})" for p in pins
    )
    reason = f"{src.reason}; {said}" if src.reason else said
    draft.sources[dotted] = Source(src.label, reason, src.location)
