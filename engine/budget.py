"""Plan, part of: the memory of a placed plan, refused when a device cannot hold it.

Input: the resolved pipeline, its placement and the cluster's device memory. Output:
`{stage: {role: Estimate}}` (per GPU), warnings between 90% and 100% of a device, and a
`PipeError` located at each stage that does not fit, listing the changes that would,
cheapest first, each with its new estimate: the kind's own proposals (its
`memory_changes` hook: `zero_stage: 3`, `gradient_checkpointing: true`, ...) and every
other memory preset of the pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from engine.errors import Diagnostic, PipeError, found
from engine.memory import Estimate, colocated, estimate, fmt
from engine.placement import ClusterView, Placement
from engine.resolved import ResolvedPipeline, ResolvedStage
from engine.stage import MemoryNeed, StageConfig

WARN_AT = 0.9


def stage_memory(
    st: ResolvedStage,
    config: StageConfig,
    slots: Sequence[Any],
    cluster: ClusterView,
) -> tuple[dict[str, Estimate], int]:
    """Each role's estimate per GPU, and the largest total on one device (roles sharing a
    device summed, sleep taken into account)."""
    per_role: dict[str, tuple[MemoryNeed, Estimate]] = {}
    guests: dict[str, list[tuple[MemoryNeed, Estimate]]] = {}  # loaded in another role's ranks
    for need in config.memory_needs():
        role = need.role or st.role or st.kind
        devices = [d for s in slots if s.role in (role, None) for d in s.devices]
        host = need.inside if need.inside and not devices else ""
        devices = devices or [d for s in slots if host and s.role == host for d in s.devices]
        dp = len(devices) or max(st.gpus, 1)
        est = estimate(need, dp, cluster.gpus_per_node, cluster.gpu_memory_bytes)
        if est is not None:
            per_role[role] = (need, replace(est, inside=host))
            if host:
                guests.setdefault(host, []).append(per_role[role])
    by_device: dict[tuple[Any, int], list[tuple[MemoryNeed, Estimate]]] = {}
    for s in slots:
        key = s.role or st.role or st.kind
        items = ([per_role[key]] if key in per_role else []) + guests.get(key, [])
        for d in s.devices if items else ():
            by_device.setdefault((s.worker or s.node, d), []).extend(items)
    # devices holding the same roles have the same total: sum each combination once
    combos = {tuple(id(item) for item in items): items for items in by_device.values()}
    peak = max((colocated(items).gpu_bytes for items in combos.values()), default=0)
    return {role: est for role, (_, est) in per_role.items()}, peak


def check_memory(
    resolved: ResolvedPipeline, placement: Placement, cluster: ClusterView
) -> tuple[dict[str, dict[str, Estimate]], list[Diagnostic]]:
    """Every GPU stage's estimate; warnings; PipeError for a stage that does not fit."""
    device = cluster.gpu_memory_bytes
    memory: dict[str, dict[str, Estimate]] = {}
    warnings: list[Diagnostic] = []
    errors: list[Diagnostic] = []
    for name, slots in placement.stages.items():
        st = resolved.stages[name]
        roles, peak = stage_memory(st, st.config, slots, cluster)
        if not roles:
            continue
        memory[name] = roles
        if device is None:
            continue
        where = _where(resolved, name)
        if peak > device:
            fixes = _fixes(resolved, st, slots, cluster)
            hint = "; ".join(f"{change} -> {fmt(gb)}" for change, gb in fixes) or "none found"
            parts = _parts(roles)
            errors.append(
                Diagnostic(
                    where,
                    f"stages.{name}",
                    f"needs {fmt(peak)} per GPU ({parts}), the GPUs have {fmt(device)}; "
                    f"changes that fit, cheapest first: {hint}",
                )
            )
        elif peak > WARN_AT * device:
            warnings.append(
                Diagnostic(
                    where,
                    f"stages.{name}",
                    f"needs {fmt(peak)} per GPU, {100 * peak / device:.0f}% of {fmt(device)}: "
                    "little headroom",
                    "warning",
                )
            )
    if errors:
        raise PipeError(errors)
    return memory, warnings


def _parts(roles: dict[str, Estimate]) -> str:
    out = []
    for role, est in roles.items():
        shown = ", ".join(f"{k} {fmt(v)}" for k, v in est.parts.items() if v)
        out.append(f"{role}: {shown}")
    return "; ".join(out)


def _where(resolved: ResolvedPipeline, name: str) -> Any:
    doc = resolved.loaded.doc
    stage = doc.data["stages"][name]
    if isinstance(stage, dict) and "resources" in stage:
        return doc.value_loc(("stages", name, "resources"))
    return doc.key_loc(("stages", name))


def _fixes(
    resolved: ResolvedPipeline, st: ResolvedStage, slots: Sequence[Any], cluster: ClusterView
) -> list[tuple[str, int]]:
    """Changes after which the stage fits, in the kind's order of cost, then other presets."""
    device = cluster.gpu_memory_bytes or 0
    out: list[tuple[str, int]] = []
    data = st.config.model_dump()
    for dotted, value in st.config.memory_changes():
        changed = _set(data, dotted, value)
        try:
            config = type(st.config).model_validate(changed)
        except Exception:
            continue
        _, peak = stage_memory(st, config, slots, cluster)
        if peak <= device:
            out.append((f"`{dotted}: {found(value)}`", peak))
    out += _preset_fixes(resolved, st, slots, cluster)
    return out


def _preset_fixes(
    resolved: ResolvedPipeline, st: ResolvedStage, slots: Sequence[Any], cluster: ClusterView
) -> list[tuple[str, int]]:
    import copy

    from engine.load import validate_document
    from engine.presets import available
    from engine.resolve import resolve
    from engine.source import Document

    loaded = resolved.loaded
    out = []
    for preset in sorted(available("memory", loaded.base_dir, loaded.spec.presets)):
        if preset == loaded.spec.memory:
            continue
        data = copy.deepcopy(loaded.doc.data)
        data["memory"] = preset
        doc = Document(loaded.doc.name, data, loaded.doc.values, loaded.doc.keys)
        try:
            other = resolve(validate_document(doc, loaded.path), resolved.run_dir)
        except PipeError:
            continue
        if st.name not in other.stages:
            continue
        _, peak = stage_memory(other.stages[st.name], other.stages[st.name].config, slots, cluster)
        if peak <= (cluster.gpu_memory_bytes or 0):
            out.append((f"`memory: {preset}`", peak))
    return out


def _set(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out = dict(data)
    node = out
    parts = dotted.split(".")
    for part in parts[:-1]:
        node[part] = dict(node[part])
        node = node[part]
    node[parts[-1]] = value
    return out
