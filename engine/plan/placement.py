"""Plan, part of: placement. Roles, GPU stages and a cluster -> the slots each stage holds.

Input: the GPU stages (each asks for GPUs per role, in tensor-parallel units
that must stay on one node), the DAG (`needs`), the roles' pools (the resolved
GPU counts per colocation group) and a `ClusterView` (the live Dask workers or a
declared cluster file). Output: a `Placement`: for every GPU stage its slots,
each a `(node, worker, device ids, role)` on one worker of one node. Pure and
deterministic: no I/O, no clock, no randomness.

Rules:
- A node offers at most `gpus_per_node` devices; a unit (a tensor-parallel
  group) never spans nodes, nor workers.
- Pools first: each colocation group of roles gets its GPUs, whole nodes first
  in node order, then the node that fits best; colocated roles share them. A
  stage's role is placed inside its pool; a stage asking for plain GPUs may use
  any device.
- Stages that can run at the same time (no path between them in the DAG) get
  disjoint devices when the pool allows it; otherwise the later one shares
  devices with them and `waits` names them (execute runs them one after the
  other). Stages with a path between them reuse devices freely.
- Every problem is collected; `PlacementError` carries them all.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from graphlib import TopologicalSorter
from typing import Any

from engine.plan.topology import ClusterView, Device, Worker
from engine.stage import Slot

__all__ = ["ClusterView", "Device", "Worker"]  # the cluster placement works with

log = logging.getLogger("pipe.placement")


@dataclass(frozen=True)
class RoleRequest:
    """GPUs one role of a stage holds (role None: a plain `resources: {gpus: n}` stage)."""

    role: str | None
    gpus: int
    unit: int = 1


@dataclass(frozen=True)
class StageRequest:
    name: str
    roles: tuple[RoleRequest, ...]


@dataclass(frozen=True)
class Pool:
    """A colocation group of roles and the GPUs it shares."""

    roles: tuple[str, ...]
    gpus: int


@dataclass(frozen=True)
class Placement:
    """Where every GPU stage (and every role's pool) sits."""

    stages: dict[str, tuple[Slot, ...]]
    pools: dict[str, tuple[Slot, ...]] = field(default_factory=dict)
    waits: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, list[dict[str, Any]]]:
        return {name: [s.as_dict() for s in slots] for name, slots in self.stages.items()}

    def render_text(self, cluster: ClusterView) -> str:
        """A table per node: each pool and stage with the devices it holds there."""
        lines = [f"placement on {cluster.describe()} GPUs (gpus_per_node {cluster.gpus_per_node}):"]
        for node in cluster.nodes():
            count = sum(1 for d in cluster.devices() if d[0] == node)
            lines.append(f"  node {node}: {count} GPUs")
            rows = [(f"role {r}", s) for r, slots in self.pools.items() for s in slots]
            rows += [(name, s) for name, slots in self.stages.items() for s in slots]
            for label, s in rows:
                if s.node != node:
                    continue
                role = f" ({s.role})" if s.role and not label.startswith("role") else ""
                worker = f"  on {s.worker}" if s.worker else ""
                lines.append(f"    {label + role:28s} devices {_ranges(s.devices)}{worker}")
        for name, others in self.waits.items():
            lines.append(f"  {name} waits for {', '.join(others)}: they would share devices")
        return "\n".join(lines) + "\n"


class PlacementError(Exception):
    """The stages cannot be placed: (stage or '' for the cluster, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{s or 'cluster'}: {m}" for s, m in problems))


def _ranges(ids: Iterable[int]) -> str:
    ids = sorted(ids)
    parts, start = [], None
    for i, d in enumerate(ids):
        start = d if start is None else start
        if i + 1 == len(ids) or ids[i + 1] != d + 1:
            parts.append(str(start) if start == d else f"{start}-{d}")
            start = None
    return ",".join(parts)


Place = tuple[str, str | None]


def _group(devices: Iterable[Device]) -> dict[Place, list[Device]]:
    """`devices` by the worker that holds them, in node order."""
    by_place: dict[Place, list[Device]] = {}
    for d in devices:
        by_place.setdefault((d[0], d[1]), []).append(d)
    return by_place


def _take(free: Sequence[Device], n: int, unit: int, per_node: int) -> list[Device] | None:
    """`n` devices of `free` in units of `unit` on one worker each: whole nodes first (in
    order), then the worker that fits the rest best, then the largest; None when they do
    not fit."""
    return _take_grouped(_group(free), n, unit, per_node)


def _take_grouped(
    by_place: Mapping[Place, list[Device]], n: int, unit: int, per_node: int
) -> list[Device] | None:
    """`_take` on devices already grouped by worker (`_group`)."""
    cap = {p: len(v) - len(v) % unit for p, v in by_place.items()}
    if sum(cap.values()) < n:
        return None
    chosen: list[Device] = []
    need = n
    for place, count in cap.items():  # whole nodes, in node order
        if per_node <= count <= need:
            chosen += by_place[place][:count]
            cap[place] = 0
            need -= count
    while need > 0:
        fits = [(c, p) for p, c in cap.items() if c >= need]
        # the tightest fit, else the largest; ties: first in node order
        place = min(fits, key=lambda cp: cp[0])[1] if fits else max(cap, key=lambda p: cap[p])
        got = by_place[place][: min(cap[place], need)]
        cap[place] = 0
        chosen += got
        need -= len(got)
    return chosen


def _capacity(devices: Sequence[Device], unit: int) -> int:
    """How many of `devices` fit in whole groups of `unit`, each group on one worker."""
    counts: dict[tuple[str, str | None], int] = {}
    for node, worker, _ in devices:
        counts[(node, worker)] = counts.get((node, worker), 0) + 1
    return sum(c - c % unit for c in counts.values())


def _slots(devices: Iterable[Device], role: str | None) -> tuple[Slot, ...]:
    groups: dict[Place, list[int]] = {}
    for node, worker, d in devices:
        groups.setdefault((node, worker), []).append(d)
    return tuple([Slot(n, w, tuple(sorted(ids)), role) for (n, w), ids in groups.items()])


def _ancestors(needs: Mapping[str, Sequence[str]], bit: Mapping[str, int]) -> dict[str, int]:
    """Every stage's ancestors (what it needs, directly or not) as a bit set over `bit`
    (the placed stages; others add no bit); iterative, so a chain of any length is fine."""
    memo: dict[str, int] = {}
    for name in TopologicalSorter(needs).static_order():
        up = 0
        for n in needs.get(name, ()):
            up |= memo[n] | bit.get(n, 0)
        memo[name] = up
    return memo


def solve(
    stages: Sequence[StageRequest],
    needs: Mapping[str, Sequence[str]],
    pools: Sequence[Pool],
    cluster: ClusterView,
    declared: int | None = None,
) -> Placement:
    """Place `stages` (in topological order) on `cluster`; see the module docstring."""
    problems: list[tuple[str, str]] = []
    devices = cluster.devices()
    per_node = cluster.gpus_per_node
    asked = declared if declared is not None else sum(p.gpus for p in pools)
    if asked > len(devices):
        offer = (
            cluster.describe() if devices else f"{len(cluster.workers)} worker(s), none with GPUs"
        )
        problems.append(
            (
                "",
                f"the pipeline asks for {asked} GPUs (cluster.gpus); the workers offer "
                f"{len(devices)} ({offer})",
            )
        )
        raise PlacementError(problems)
    units = {r.role: r.unit for s in stages for r in s.roles if r.role}
    pool_devices: dict[str, list[Device]] = {}
    free = list(devices)
    for pool in pools:
        unit = max((units.get(r, 1) for r in pool.roles), default=1)
        got = _take(free, pool.gpus, unit, per_node) if pool.gpus else []
        if got is None:
            problems.append(
                (
                    "",
                    f"role(s) {', '.join(pool.roles)} need {pool.gpus} GPUs in tensor-parallel "
                    f"groups of {unit}, each on one node; {_capacity(free, unit)} of the "
                    f"{len(free)} free GPUs can be grouped so",
                )
            )
            continue
        free = [d for d in free if d not in got]
        for role in pool.roles:
            pool_devices[role] = got
    bit = {st.name: 1 << i for i, st in enumerate(stages)}
    ancestors = _ancestors(needs, bit)
    placed: dict[str, set[Device]] = {}
    placed_bits = 0
    out: dict[str, tuple[Slot, ...]] = {}
    waits: dict[str, tuple[str, ...]] = {}
    grouped: dict[int, dict[Place, list[Device]]] = {}
    held_memo: dict[int, tuple[list[str], set[Device]]] = {}
    free_memo: dict[tuple[int, int], dict[Place, list[Device]]] = {}
    slot_memo: dict[tuple[str | None, tuple[Device, ...]], tuple[Slot, ...]] = {}
    for st in stages:
        # `stages` are in topological order: no stage placed before this one needs it, so
        # those that may run beside it are the placed ones it does not need (a bit set;
        # in a chain it is the same set stage after stage, so what it holds is kept).
        beside = placed_bits & ~ancestors.get(st.name, 0)
        if beside not in held_memo:
            concurrent = [o for o in placed if bit[o] & beside]
            held_memo[beside] = (concurrent, set().union(*(placed[o] for o in concurrent)))
        concurrent, held = held_memo[beside]
        slots: list[Slot] = []
        mine: set[Device] = set()
        done_pools: dict[int, list[Device]] = {}
        for req in st.roles:
            where = pool_devices.get(req.role, devices) if req.role else devices
            key = id(where)  # colocated roles share one device list
            if key in done_pools and req.role:  # a colocated role: the same devices
                slots.extend(_slots(done_pools[key], req.role))
                continue
            problem = _unit_problem(req, per_node)
            if problem is None and req.gpus > len(where):
                owner = f"role '{req.role}' has" if req.role else "the cluster has"
                problem = f"asks for {req.gpus} GPUs; {owner} {len(where)}"
            if problem is not None:
                problems.append((st.name, problem))
                continue
            if key not in grouped:
                grouped[key] = _group(where)
            free_here = grouped[key]
            if held:
                if (key, beside) not in free_memo:
                    free_memo[(key, beside)] = {
                        p: [d for d in v if d not in held] for p, v in free_here.items()
                    }
                free_here = free_memo[(key, beside)]
            got = _take_grouped(free_here, req.gpus, req.unit, per_node)
            if got is None:
                got = _take_grouped(grouped[key], req.gpus, req.unit, per_node)
                if got is None:
                    problems.append(
                        (
                            st.name,
                            f"asks for {req.gpus} GPUs in tensor-parallel groups of {req.unit}, "
                            f"each on one node; {_capacity(where, req.unit)} of the "
                            f"{len(where)} GPUs it may use can be grouped so",
                        )
                    )
                    continue
                taken = set(got)
                waits[st.name] = tuple(o for o in concurrent if not placed[o].isdisjoint(taken))
            done_pools[key] = got
            mine.update(got)
            memo_key = (req.role, tuple(got))  # stages in a chain often get the same devices
            if memo_key not in slot_memo:
                slot_memo[memo_key] = _slots(got, req.role)
            slots.extend(slot_memo[memo_key])
        placed[st.name] = mine
        placed_bits |= bit[st.name]
        out[st.name] = tuple(slots)
    if problems:
        raise PlacementError(problems)
    pool_slots = {r: _slots(d, r) for r, d in pool_devices.items()}
    return Placement(out, pool_slots, {k: v for k, v in waits.items() if v})


def _unit_problem(req: RoleRequest, per_node: int) -> str | None:
    if req.unit > per_node or per_node % req.unit:
        fits = ", ".join(str(n) for n in range(1, per_node + 1) if per_node % n == 0)
        return (
            f"tensor-parallel size {req.unit} does not fit on a node of {per_node} GPUs; "
            f"a tensor-parallel group never spans nodes: use {fits}"
        )
    if req.gpus % req.unit:
        return f"{req.gpus} GPUs do not split into tensor-parallel groups of {req.unit}"
    return None
