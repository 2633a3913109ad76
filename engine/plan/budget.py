"""Plan, part of: the memory of a placed plan, refused when a GPU or a host cannot hold it.

Input: the resolved pipeline, its placement and the cluster's memory figures (each
worker's GPUs, each node's host; a figure that is unknown is not checked). Output:
`{stage: {role: Estimate}}` (per GPU, with the role's ranks per node), warnings between
90% and 100% of a GPU or a host, and a `PipeError` located at each stage that does not
fit, naming where, listing the changes that would, cheapest first, each with its new
estimate: the kind's own proposals (its `memory_changes` hook: `zero_stage: 3`,
`gradient_checkpointing: true`, ...) and every other memory preset of the pipeline. A
change fits when every GPU and every host the stage uses holds it.

GPU: every device holds the roles placed on it (colocated roles summed, sleep taken into
account) against its own memory; a role is estimated against the smallest GPU among the
workers it holds (vLLM's share is a fraction of that GPU). Host: every node holds, for
each role of the stage, its ranks there x the role's host bytes per rank (`Estimate`),
against the node's host memory. A stage is checked alone: stages that run at the same
time on one node are not summed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine.errors import Diagnostic, PipeError, found
from engine.plan.memory import Estimate, colocated, estimate, fmt
from engine.plan.placement import ClusterView, Placement
from engine.resolve.resolve import resolve_changed
from engine.resolve.types import ResolvedPipeline, ResolvedStage
from engine.stage import MemoryNeed, StageConfig

WARN_AT = 0.9
GROW_UP_TO = 32  # a bigger cluster is tried up to this many times the nodes

# the pipeline planned on a cluster k times as large: (resolved, placement, cluster)
Grown = tuple[ResolvedPipeline, Placement, ClusterView]
Grow = Callable[[int], Grown | None]


@dataclass(frozen=True)
class Load:
    """What a stage needs on one GPU (its peak) or on one node's host, and what it has
    (None: unknown, not checked); `nodes` where that is so."""

    nodes: tuple[str, ...]
    need: int
    capacity: int | None

    @property
    def over(self) -> bool:
        return self.capacity is not None and self.need > self.capacity

    @property
    def share(self) -> float:
        return self.need / self.capacity if self.capacity else 0.0


@dataclass(frozen=True)
class StageMemory:
    """A placed stage's estimate per role, its GPU loads and its host load per node."""

    roles: dict[str, Estimate]
    gpu: tuple[Load, ...]
    host: tuple[Load, ...]

    def fits(self) -> bool:
        return not any(load.over for load in (*self.gpu, *self.host))


def stage_memory(
    st: ResolvedStage,
    config: StageConfig,
    slots: Sequence[Any],
    cluster: ClusterView,
) -> StageMemory:
    """Each role's estimate (per GPU, against the smallest GPU it holds; its ranks per
    node), the peak on each kind of device, and the host bytes on each node."""
    per_role: dict[str, tuple[MemoryNeed, Estimate]] = {}
    guests: dict[str, list[tuple[MemoryNeed, Estimate]]] = {}  # loaded in another role's ranks
    own = st.role or st.kind
    for need in config.memory_needs():
        role = need.role or own
        mine = [s for s in slots if (s.role or own) == role]
        host = need.inside.replace("stage", own) if need.inside and not mine else ""
        mine = mine or [s for s in slots if host and (s.role or own) == host]  # in its ranks
        dp = sum(len(s.devices) for s in mine) or max(st.gpus, 1)
        device = _smallest(cluster.gpu_memory(s.node, s.worker) for s in mine)
        est = estimate(need, dp, cluster.gpus_per_node, device)
        if est is not None:
            ranks: dict[str, int] = {}
            for s in mine:
                ranks[s.node] = ranks.get(s.node, 0) + len(s.devices)
            per_role[role] = (need, replace(est, nodes=ranks, inside=host))
            if host:
                guests.setdefault(host, []).append(per_role[role])
    return StageMemory(
        {role: est for role, (_, est) in per_role.items()},
        _gpu_loads(st, slots, cluster, per_role, guests),
        _host_loads(cluster, per_role),
    )


def _smallest(sizes: Iterable[int | None]) -> int | None:
    known = [s for s in sizes if s is not None]
    return min(known) if known else None


def _gpu_loads(
    st: ResolvedStage,
    slots: Sequence[Any],
    cluster: ClusterView,
    per_role: dict[str, tuple[MemoryNeed, Estimate]],
    guests: dict[str, list[tuple[MemoryNeed, Estimate]]],
) -> tuple[Load, ...]:
    """The peak on every device (the roles it holds summed, with what loads inside their
    ranks), one `Load` per combination of roles and device memory."""
    by_device: dict[tuple[Any, int], list[tuple[MemoryNeed, Estimate]]] = {}
    where: dict[tuple[Any, int], tuple[str, int | None]] = {}
    for s in slots:
        key = s.role or st.role or st.kind
        items = ([per_role[key]] if key in per_role else []) + guests.get(key, [])
        if not items:
            continue
        capacity = cluster.gpu_memory(s.node, s.worker)
        for d in s.devices:
            by_device.setdefault((s.worker or s.node, d), []).extend(items)
            where[(s.worker or s.node, d)] = (s.node, capacity)
    # devices holding the same roles have the same total: sum each combination once
    peaks: dict[tuple[int, ...], int] = {}
    groups: dict[tuple[tuple[int, ...], int | None], list[str]] = {}
    for key, items in by_device.items():
        combo = tuple(id(item) for item in items)
        if combo not in peaks:
            peaks[combo] = colocated(items).gpu_bytes
        node, capacity = where[key]
        nodes = groups.setdefault((combo, capacity), [])
        if node not in nodes:
            nodes.append(node)
    return tuple(Load(tuple(n), peaks[c], cap) for (c, cap), n in groups.items())


def _host_loads(
    cluster: ClusterView, per_role: dict[str, tuple[MemoryNeed, Estimate]]
) -> tuple[Load, ...]:
    """Every node's host bytes: each role's ranks there x its host bytes per rank."""
    need: dict[str, int] = {}
    for _, est in per_role.values():
        for node, ranks in est.nodes.items():
            need[node] = need.get(node, 0) + ranks * est.host_bytes
    return tuple(Load((node,), n, cluster.host_memory(node)) for node, n in need.items())


def check_memory(
    resolved: ResolvedPipeline,
    placement: Placement,
    cluster: ClusterView,
    grow: Grow | None = None,
) -> tuple[dict[str, dict[str, Estimate]], list[Diagnostic]]:
    """Every GPU stage's estimate; warnings; PipeError for a stage that does not fit. A
    host that is too small also gets, last, the smallest bigger cluster of the same nodes
    that fits (`grow`: the pipeline planned on k times the cluster), when one does."""
    memory: dict[str, dict[str, Estimate]] = {}
    warnings: list[Diagnostic] = []
    errors: list[Diagnostic] = []
    uniform = len({s for s in cluster.gpu_memory_by_node().values() if s is not None}) <= 1
    for name, slots in placement.stages.items():
        st = resolved.stages[name]
        sm = stage_memory(st, st.config, slots, cluster)
        if not sm.roles:
            continue
        memory[name] = sm.roles
        where, path = _where(resolved, name), f"stages.{name}"
        for host, load in ((False, _worst(sm.gpu)), (True, _worst(sm.host))):
            if load is None or load.share <= WARN_AT:
                continue
            if host:  # name every node as short as the worst one
                same = (load.need, load.capacity)
                load = replace(
                    load, nodes=tuple(x.nodes[0] for x in sm.host if (x.need, x.capacity) == same)
                )
            if not load.over:
                warnings.append(Diagnostic(where, path, _headroom(load, host, uniform), "warning"))
                continue
            fixes = _kind_fixes(st, slots, cluster, host)
            fixes += _preset_fixes(resolved, st, slots, cluster, host)
            if host and grow is not None:
                fixes += _grow_fix(name, grow, resolved.loaded.spec.cluster.gpus)
            hint = "; ".join(f"{change} -> {fmt(n)}" for change, n in fixes) or "none found"
            needs = _host_needs(load, sm.roles) if host else _gpu_needs(load, sm.roles, uniform)
            errors.append(
                Diagnostic(where, path, f"{needs}; changes that fit, cheapest first: {hint}")
            )
    if errors:
        raise PipeError(errors)
    return memory, warnings


def _worst(loads: Sequence[Load]) -> Load | None:
    """The load nearest its capacity (None when no capacity is known)."""
    known = [load for load in loads if load.capacity]
    return max(known, key=lambda load: load.share) if known else None


def _nodes(nodes: Sequence[str]) -> str:
    names = ", ".join(f"'{n}'" for n in nodes)
    return f"node {names}" if len(nodes) == 1 else f"nodes {names}"


def _gpu_needs(load: Load, roles: dict[str, Estimate], uniform: bool) -> str:
    """`needs X per GPU (parts), the GPUs have Y`, naming the nodes when GPUs differ."""
    shown = "; ".join(
        f"{role}: " + ", ".join(f"{k} {fmt(v)}" for k, v in est.parts.items() if v)
        for role, est in roles.items()
    )
    have = "the GPUs have" if uniform else f"the GPUs of {_nodes(load.nodes)} have"
    return f"needs {fmt(load.need)} per GPU ({shown}), {have} {fmt(load.capacity or 0)}"


def _host_needs(load: Load, roles: dict[str, Estimate]) -> str:
    """`needs X of host memory on node 'n' (role: k ranks x B), the node has Y` (the ranks
    of the first node named)."""
    node = load.nodes[0]
    shown = ", ".join(
        f"{role}: {est.nodes[node]} ranks x {fmt(est.host_bytes)}"
        for role, est in roles.items()
        if est.nodes.get(node) and est.host_bytes
    )
    return (
        f"needs {fmt(load.need)} of host memory on {_nodes(load.nodes)} ({shown}), "
        f"{'the node has' if len(load.nodes) == 1 else 'each has'} {fmt(load.capacity or 0)}"
    )


def _headroom(load: Load, host: bool, uniform: bool) -> str:
    capacity = fmt(load.capacity or 0)
    if host:
        return (
            f"needs {fmt(load.need)} of host memory on {_nodes(load.nodes)}, "
            f"{100 * load.share:.0f}% of {capacity}: little headroom"
        )
    on = "" if uniform else f" on {_nodes(load.nodes)}"
    return (
        f"needs {fmt(load.need)} per GPU{on}, {100 * load.share:.0f}% of {capacity}: "
        "little headroom"
    )


def _where(resolved: ResolvedPipeline, name: str) -> Any:
    doc = resolved.loaded.doc
    stage = doc.data["stages"][name]
    if isinstance(stage, dict) and "resources" in stage:
        return doc.value_loc(("stages", name, "resources"))
    return doc.key_loc(("stages", name))


def _figure(sm: StageMemory, host: bool) -> int:
    """What a fix is shown with: the largest host need of a node, or the GPU peak."""
    return max((load.need for load in (sm.host if host else sm.gpu)), default=0)


def _kind_fixes(
    st: ResolvedStage, slots: Sequence[Any], cluster: ClusterView, host: bool
) -> list[tuple[str, int]]:
    """The kind's changes after which the stage fits (every GPU and host), in its order of
    cost; each with its new GPU peak, or host need per node when `host`."""
    out: list[tuple[str, int]] = []
    data = st.config.model_dump()
    for dotted, value in st.config.memory_changes():
        changed = _set(data, dotted, value)
        try:
            config = type(st.config).model_validate(changed)
        except Exception:
            continue
        sm = stage_memory(st, config, slots, cluster)
        if sm.fits():
            out.append((f"`{dotted}: {found(value)}`", _figure(sm, host)))
    return out


def _preset_fixes(
    resolved: ResolvedPipeline,
    st: ResolvedStage,
    slots: Sequence[Any],
    cluster: ClusterView,
    host: bool,
) -> list[tuple[str, int]]:
    """The pipeline's other memory presets after which the stage fits, as `_kind_fixes`."""
    from engine.load.presets import available

    loaded = resolved.loaded
    out = []
    gpus = len(cluster.devices()) if loaded.spec.cluster.gpus == "auto" else None
    for preset in sorted(available("memory", loaded.base_dir, loaded.spec.presets)):
        if preset == loaded.spec.memory:
            continue
        try:
            other = resolve_changed(resolved, {"memory": preset}, gpus)
        except PipeError:
            continue
        if st.name not in other.stages:
            continue
        sm = stage_memory(other.stages[st.name], other.stages[st.name].config, slots, cluster)
        if sm.fits():
            out.append((f"`memory: {preset}`", _figure(sm, host)))
    return out


def _grow_fix(name: str, grow: Grow, declared: int | str) -> list[tuple[str, int]]:
    """The smallest multiple of the cluster (and of `cluster.gpus`) on which stage `name`
    fits, as a change: host memory per node falls with more nodes only where the host
    holds a share of the states (ZeRO-3 with `adam_offload`)."""
    for k in range(2, GROW_UP_TO + 1):
        got = grow(k)
        if got is None or name not in got[1].stages:
            continue
        other, placement, bigger = got
        st = other.stages[name]
        sm = stage_memory(st, st.config, placement.stages[name], bigger)
        if sm.fits():
            used = {s.node for slots in placement.stages.values() for s in slots}
            nodes = f"{len(used)} nodes like these"
            change = (
                f"`cluster.gpus: {declared * k}` on {nodes}" if isinstance(declared, int) else nodes
            )
            return [(change, _figure(sm, True))]
    return []


def _set(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out = dict(data)
    node = out
    parts = dotted.split(".")
    for part in parts[:-1]:
        node[part] = dict(node[part])
        node = node[part]
    node[parts[-1]] = value
    return out
