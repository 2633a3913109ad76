"""Plan: `ResolvedPipeline` -> `Plan`, the DAG in execution order with a cache key per stage.

The graph comes from `needs:` (cycles were rejected at load). Each stage's
static key hashes its resolved config and its kind's code version; execution
adds the hashes of its inputs (upstream keys and external file contents).
Every stage renders the run's date (`Plan.date`, `engine.plan.dated`): a stage whose model's
chat template reads the date has it in its static key (`PlannedStage.reads_date` names the
model field), and the sha256 of every single-file model a stage reads (a GGUF) is recorded
(`PlannedStage.model_files`, `engine.plan.checksums`). `Plan.as_dict()` is what `pipe plan
--format json|yaml` prints and what `pipe run` writes as `plan.lock.yaml`;
`engine.plan.explain` adds each value's source.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from datetime import date
from typing import Any

from engine.errors import Diagnostic, PipeError
from engine.fsio import exists
from engine.load.graph import topological
from engine.load.schema import ROLES
from engine.plan.budget import Grow, Grown, check_memory
from engine.plan.checksums import HashCache, model_files
from engine.plan.dated import reads_date, run_date
from engine.plan.memory import Estimate
from engine.plan.placement import (
    ClusterView,
    Placement,
    PlacementError,
    Pool,
    RoleRequest,
    StageRequest,
    solve,
)
from engine.resolve.paths import shown, shown_config
from engine.resolve.resolve import resolve_changed
from engine.resolve.types import ResolvedPipeline, ResolvedStage
from engine.stage import kinds


@dataclass(frozen=True)
class PlannedStage:
    """A stage ready to run: resolved config, resources and static cache key."""

    resolved: ResolvedStage
    config_hash: str
    code_version: str
    reads_date: str | None = None  # the model field whose chat template reads the date
    # sha256 of each single-file model the stage reads (a GGUF), by path (`engine.plan.checksums`)
    model_files: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.resolved.name

    @property
    def outputs(self) -> dict[str, str]:
        cfg = self.resolved.config
        return {f: str(getattr(cfg, f)) for f in type(cfg).OUTPUTS}


@dataclass(frozen=True)
class Plan:
    """The stages in execution order; where they sit when a cluster is known."""

    resolved: ResolvedPipeline
    order: tuple[str, ...]
    stages: dict[str, PlannedStage]
    cluster: ClusterView | None = None
    placement: Placement | None = None
    memory: dict[str, dict[str, Estimate]] | None = None
    date: date | None = None  # the day every stage's chat template renders
    date_source: str = ""

    @property
    def name(self) -> str:
        return self.resolved.name

    def as_dict(self) -> dict[str, Any]:
        spec = self.resolved.loaded.spec
        gpus_auto = spec.cluster.gpus == "auto" and not self.resolved.roles
        roles: dict[str, Any] = {r: a.as_dict() for r, a in self.resolved.roles.items()}
        raw = self.resolved.loaded.doc.data.get("resources")
        if gpus_auto and isinstance(raw, dict) and "ratio" in raw:
            # resolved from the workers at run time; the run's plan.lock.yaml has the numbers
            roles = {r: {"gpus": "auto", "colocated_with": []} for r in spec.resources.ratio}
        return {
            "name": spec.name,
            "profile": spec.profile,
            "memory": spec.memory,
            **({"date": self.date.isoformat()} if self.date is not None else {}),
            "stages": {
                n: {
                    "kind": s.resolved.kind,
                    "needs": list(s.resolved.needs),
                    "resources": {"role": s.resolved.role, "gpus": s.resolved.gpus},
                    "config": shown_config(s.resolved.config),
                    **({"date_in_key": s.reads_date} if s.reads_date else {}),
                    **(
                        {"hub": [{"field": p.field, **p.as_dict()} for p in s.resolved.pins]}
                        if s.resolved.pins
                        else {}
                    ),
                    **(
                        {"sha256": {shown(p): d for p, d in s.model_files.items()}}
                        if s.model_files
                        else {}
                    ),
                }
                for n, s in self.stages.items()
            },
            "roles": roles,
            **({"placement": self.placement.as_dict()} if self.placement is not None else {}),
            **(
                {
                    "memory": {
                        s: {r: e.as_dict() for r, e in m.items()} for s, m in self.memory.items()
                    }
                }
                if self.memory is not None
                else {}
            ),
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2) + "\n"

    def to_yaml(self) -> str:
        from ruamel.yaml import YAML

        yaml = YAML(typ="safe", pure=True)
        yaml.default_flow_style = False
        buf = io.StringIO()
        buf.write(f"# plan of {self.resolved.loaded.path}: every value resolved\n")
        yaml.dump(self.as_dict(), buf)
        return buf.getvalue()


def config_hash(stage: ResolvedStage, day: date | None = None) -> str:
    """Hash of the resolved config, paths as shown (so a moved project keeps its cache), and
    the run's date where given (a stage whose model's chat template reads it)."""
    text = json.dumps(shown_config(stage.config), sort_keys=True)
    dated = f"\ndate={day.isoformat()}" if day is not None else ""
    return hashlib.sha256(f"{stage.kind}\n{text}{dated}".encode()).hexdigest()[:16]


def plan(resolved: ResolvedPipeline, cluster: ClusterView | None = None) -> Plan:
    """Order the stages and compute their static cache keys; with a cluster (declared or
    live), place every GPU stage (`PipeError` with located messages when they do not fit)."""
    order = tuple(topological(resolved.loaded.spec))
    registry = kinds()
    day, day_source = run_date(resolved.loaded.spec.date, resolved.run_dir)
    stages = {}
    memo = HashCache.of_run(resolved.run_dir)
    for name in order:
        stage = resolved.stages[name]
        dated = reads_date(stage.config)
        stages[name] = PlannedStage(
            stage,
            config_hash(stage, day if dated else None),
            registry[stage.kind].code_version(),
            dated,
            model_files(stage.config, memo),
        )
    if exists(resolved.run_dir):  # a run folder already made keeps the memo; planning makes none
        memo.save()
    placement = place(resolved, order, cluster) if cluster is not None else None
    if resolved.gpus_auto is not None:
        resolved.notes.append(auto_note(resolved, placement))
    memory = None
    if placement is not None and cluster is not None:
        memory, warnings = check_memory(resolved, placement, cluster, _grower(resolved, cluster))
        resolved.notes.extend(warnings)
    return Plan(resolved, order, stages, cluster, placement, memory, day, day_source)


def auto_note(resolved: ResolvedPipeline, placement: Placement | None) -> Diagnostic:
    """What `cluster.gpus: auto` came to, from where, and where that puts the stages asking
    for GPUs: on the CPU at 0, else on the devices the placement gave them."""
    auto = resolved.gpus_auto
    assert auto is not None
    head = f"auto -> {auto.gpus} ({auto.source})"
    if not auto.gpus:
        wanting = f" ({', '.join(auto.wanting)} would take GPUs)" if auto.wanting else ""
        message = f"{head}: stages run on the CPU{wanting}"
    elif placement is None or not placement.stages:
        message = head
    else:
        where: dict[str, list[str]] = {}
        for name, slots in placement.stages.items():
            ids = sorted({(s.node, d) for s in slots for d in s.devices})
            nodes = {n for n, _ in ids}
            shown = ", ".join(str(d) if len(nodes) == 1 else f"{n}:{d}" for n, d in ids)
            where.setdefault(f"GPU{'s' if len(ids) > 1 else ''} {shown}", []).append(name)
        message = head + ": " + "; ".join(f"{', '.join(n)} on {d}" for d, n in where.items())
    loc = resolved.loaded.doc.value_loc(("cluster", "gpus"))
    return Diagnostic(loc, "cluster.gpus", message, "note")


def _grower(resolved: ResolvedPipeline, cluster: ClusterView) -> Grow:
    """The pipeline planned on k times `cluster` with k times its GPUs (None where it does
    not resolve or place), each k computed once: how `engine.plan.budget` tries a bigger cluster."""
    memo: dict[int, Grown | None] = {}

    def grow(k: int) -> Grown | None:
        if k not in memo:
            memo[k] = _grown(resolved, cluster, k)
        return memo[k]

    return grow


def _grown(resolved: ResolvedPipeline, cluster: ClusterView, k: int) -> Grown | None:
    bigger = cluster.grown(k)
    declared = resolved.loaded.spec.cluster.gpus
    if isinstance(declared, int):
        changes, gpus = {"cluster.gpus": declared * k}, None
    else:  # auto: the cluster's GPUs
        changes, gpus = {}, len(bigger.devices())
    try:
        other = resolve_changed(resolved, changes, gpus)
        return other, place(other, tuple(topological(other.loaded.spec)), bigger), bigger
    except PipeError:
        return None


def place(resolved: ResolvedPipeline, order: tuple[str, ...], cluster: ClusterView) -> Placement:
    """The placement of the GPU stages on `cluster`; located errors when they do not fit."""
    requests = []
    for name in order:
        st = resolved.stages[name]
        if st.gpus and st.roles:  # a stage holding several roles: each on its pool
            held = tuple(
                RoleRequest(r, resolved.roles[r].gpus, st.config.gpu_unit(r))
                for r in st.roles
                if r in resolved.roles and resolved.roles[r].gpus
            )
            requests.append(StageRequest(name, held))
        elif st.gpus:
            unit = st.config.gpu_unit()
            requests.append(StageRequest(name, (RoleRequest(st.role, st.gpus, unit),)))
    groups = {
        tuple(r for r in ROLES if r == role or r in alloc.colocated_with): alloc.gpus
        for role, alloc in resolved.roles.items()
    }
    pools = [Pool(roles, gpus) for roles, gpus in groups.items() if gpus]
    spec = resolved.loaded.spec
    declared = spec.cluster.gpus if isinstance(spec.cluster.gpus, int) else None
    needs = {n: s.needs for n, s in spec.stages.items()}
    try:
        placement = solve(requests, needs, pools, cluster, declared if declared else None)
    except PlacementError as exc:
        raise PipeError(_located(resolved, exc.problems)) from None
    problems = []
    for name, slots in placement.stages.items():
        tasks = {(s.node, s.worker) for s in slots}
        if len(tasks) > 1 and not type(resolved.stages[name].config).SPANS_NODES:
            problems.append(
                (
                    name,
                    f"a {resolved.stages[name].kind} stage runs on one worker; its "
                    f"{resolved.stages[name].gpus} GPUs were placed on {len(tasks)}: ask for at "
                    f"most one worker's GPUs",
                )
            )
    if problems:
        raise PipeError(_located(resolved, problems))
    return placement


def _located(resolved: ResolvedPipeline, problems: list[tuple[str, str]]) -> list[Diagnostic]:
    doc = resolved.loaded.doc
    out = []
    for stage, message in problems:
        if stage:
            path: tuple[str, ...] = ("stages", stage, "resources")
            where = (
                doc.value_loc(path)
                if "resources" in doc.data["stages"][stage]
                else doc.key_loc(("stages", stage))
            )
            out.append(Diagnostic(where, ".".join(path), message))
        else:
            out.append(Diagnostic(doc.value_loc(("cluster", "gpus")), "cluster.gpus", message))
    return out
