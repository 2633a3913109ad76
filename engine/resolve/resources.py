"""Resolve, part of: GPU roles. Split `cluster.gpus` among roles by `ratio`, apply colocation,
check the arithmetic.

Input: the pipeline's cluster and resources sections (already preset-resolved
colocation) and the roles its stages use. Output: `{role: RoleAlloc(gpus,
colocated_with)}` or located errors. Rules:

- Only the roles some stage uses take part: a role of the ratio that no stage
  uses gets no GPUs (a warning says so), and without a written ratio each used
  role weighs 1 (8 GPUs and one `role: actor` stage: the actor gets 8).

- Without colocation each role gets `gpus * r / sum(ratio)`; a split that does
  not divide is an error listing GPU counts that would.
- A colocation group is one unit of the split: its members share the same GPUs
  (its weight is the largest ratio among members named in `ratio`).
  `colocate: all` puts every role on all GPUs (the hybrid engine).
- `gpus: 0` (CPU only) gives every role 0 GPUs; `gpus: auto` is resolved from
  the Dask workers' resources at run time (`allocate` is called again then).
- A role a stage's kind cannot use (its `refused_roles` for the stage's config, e.g.
  `reward` for an rl stage without a reward model) is an error where it is named: that
  stage's `resources.role`, or the ratio when no stage uses the role (instead of the
  warning above).
"""

from __future__ import annotations

from typing import Any

from engine.errors import Diagnostic, Location
from engine.load.load import stage_config_data
from engine.load.schema import ROLES, PipelineSpec
from engine.load.source import Document, PathT, render_path
from engine.stage import RoleAlloc, kinds


def colocation_groups(
    ratio: dict[str, int], colocate: Any, used: frozenset[str] | None = None
) -> list[tuple[str, ...]]:
    """Units of the split: tuples of roles that share GPUs (singletons for the rest); only the
    roles in `used` (default: those of the ratio) take part."""
    used = frozenset(ratio) if used is None else used
    roles = [r for r in ROLES if r in ratio and r in used]
    if colocate == "all":
        every = [r for r in ROLES if r in used]
        return [tuple(every)] if every else []
    groups: list[tuple[str, ...]] = []
    grouped: set[str] = set()
    if isinstance(colocate, list):
        for group in colocate:
            members = tuple(r for r in ROLES if r in group and r in used)
            if members:
                groups.append(members)
                grouped.update(members)
    groups += [(r,) for r in roles if r not in grouped]
    return sorted(groups, key=lambda g: ROLES.index(g[0]))


def allocate(
    gpus: int,
    ratio: dict[str, int],
    colocate: Any,
    where: Location,
    ratio_text: str,
    used: frozenset[str] | None = None,
) -> tuple[dict[str, RoleAlloc], list[Diagnostic]]:
    """Split `gpus` among the `used` roles; the error (if any) is located at `where`."""
    groups = colocation_groups(ratio, colocate, used)
    weights = [max((ratio.get(r, 0) for r in g), default=0) or 1 for g in groups]
    total = sum(weights)
    out: dict[str, RoleAlloc] = {}
    if gpus and total and gpus % total:
        lower = gpus - gpus % total
        options = [n for n in (lower, lower + total) if n > 0]
        words = " or ".join(str(n) for n in options)
        msg = (
            f"{gpus} GPUs do not split {ratio_text} into whole GPUs per role"
            f"; GPU counts that would: {words} (a multiple of {total})"
        )
        return out, [Diagnostic(where, "cluster.gpus", msg)]
    for group, weight in zip(groups, weights, strict=True):
        share = gpus * weight // total if total else 0
        for role in group:
            out[role] = RoleAlloc(share, tuple(r for r in group if r != role))
    return out, []


def ratio_text(ratio: dict[str, int]) -> str:
    """`{vllm: 1, actor: 1, critic: 1}` -> `vllm:actor:critic = 1:1:1`."""
    roles = [r for r in ROLES if r in ratio]
    return f"{':'.join(roles)} = {':'.join(str(ratio[r]) for r in roles)}"


def refused_roles(
    doc: Document, spec: PipelineSpec, used: frozenset[str], errors: list[Diagnostic]
) -> set[str]:
    """Errors (appended to `errors`) for each role a stage's kind refuses (its
    `refused_roles` for the stage's config, with the kind's reason): named in the stage's
    `resources.role`, or in the written ratio while no stage uses it; returns the stages whose
    own role was refused."""
    written = doc.data.get("resources")
    ratio = spec.resources.ratio if isinstance(written, dict) and "ratio" in written else {}
    out = errors
    stages: set[str] = set()
    for name, st in spec.stages.items():
        kind = kinds().get(st.kind)
        refused = (
            kind.config.refused_roles(stage_config_data(spec, name, kind))
            if kind is not None
            else {}
        )
        named: list[tuple[PathT, str]] = [
            (("resources", "ratio", str(r)), str(r)) for r in ratio if str(r) not in used
        ]
        if st.resources.role:
            named.append((("stages", name, "resources", "role"), st.resources.role))
        for path, role in named:
            if role not in refused:
                continue
            where = doc.key_loc(path) if path[0] == "resources" else doc.value_loc(path)
            why = f"stage '{name}' cannot use role '{role}': {refused[role]}"
            out.append(Diagnostic(where, render_path(path), why))
            stages.update([name] if path[0] == "stages" else [])
    return stages
