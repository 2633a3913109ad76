"""Plan, part of: `pipe plan --explain`, every resolved value beside the source it came from."""

from __future__ import annotations

import json
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

from engine.plan.memory import Estimate, fmt
from engine.resolve.paths import shown, shown_config
from engine.stage import nested_blocks

if TYPE_CHECKING:
    from engine.plan.dag import Plan
    from engine.plan.topology import ClusterView
    from engine.resolve.types import ResolvedStage


def _flat(data: dict[str, Any], blocks: AbstractSet[str]) -> list[tuple[str, Any]]:
    """Dotted leaves: the values of nested blocks one by one, the rest whole."""
    out: list[tuple[str, Any]] = []
    for key, value in data.items():
        if isinstance(value, dict) and value and key in blocks:
            out.extend((f"{key}.{k}", v) for k, v in value.items())
        else:
            out.append((key, value))
    return out


def _value(value: Any) -> str:
    return json.dumps(value, separators=(", ", ": "))


def _source(stage: ResolvedStage, dotted: str) -> str:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        src = stage.sources.get(".".join(parts[:i]))
        if src is not None:
            return src.render()
    return "kind default"


def explain(plan: Plan) -> str:
    res = plan.resolved
    spec = res.loaded.spec
    lines = [
        f"pipeline {spec.name} ({res.loaded.path}): profile {spec.profile}, memory {spec.memory}"
    ]
    lines.append(f"run directory: {res.run_dir}")
    c = spec.cluster
    workers = f", {c.workers} workers" if c.scheduler == "local" else ""
    gpus = f"{c.gpus} GPUs"
    if res.gpus_auto is not None:
        gpus = f"auto -> {res.gpus_auto.gpus} GPUs ({res.gpus_auto.source})"
    lines.append(f"cluster: {c.scheduler}{workers}, {gpus}, {c.gpus_per_node} per node")
    lines.append(f"colocate: {_value(res.colocate)}  <- {res.colocate_source.render()}")
    lines.append("roles:")
    for role, alloc in plan.as_dict()["roles"].items():
        shared = (
            f" (shared with {', '.join(alloc['colocated_with'])})"
            if alloc["colocated_with"]
            else ""
        )
        lines.append(f"  {role:8s} {alloc['gpus']} GPUs{shared}")
    for name in plan.order:
        st = res.stages[name]
        needs = f" <- {', '.join(st.needs)}" if st.needs else ""
        lines.append("")
        lines.append(f"stage {name} ({st.kind}){needs}: {st.gpus} GPUs, {st.retries} retries")
        items = _flat(shown_config(st.config), nested_blocks(type(st.config)))
        width = max((len(k) for k, _ in items), default=0)
        for dotted, value in items:
            lines.append(f"  {dotted:{width}s}  {_value(value)}  <- {_source(st, dotted)}")
        for path, digest in plan.stages[name].model_files.items():
            lines.append(f"  sha256 of {shown(path)}: {digest}")
    if plan.placement is not None and plan.cluster is not None:
        lines.append("")
        lines.append(plan.placement.render_text(plan.cluster).rstrip("\n"))
    if plan.memory and plan.cluster is not None:
        lines += ["", *_memory_lines(plan.memory, plan.cluster)]
    if res.notes:
        lines.append("")
        lines += [d.render() for d in res.notes]
    return "\n".join(lines) + "\n"


def _memory_lines(memory: dict[str, dict[str, Estimate]], cluster: ClusterView) -> list[str]:
    """Each stage's roles per GPU (against each node's GPUs), then its host bytes per node
    (each role's ranks there x its host bytes per rank, against the node's host memory)."""
    sizes = cluster.gpu_memory_by_node()
    known = {s for s in sizes.values() if s is not None}
    if len(known) == 1:
        of = f" (of {fmt(known.pop())})"
    else:
        of = " (" + ", ".join(f"{n} {fmt(s)}" for n, s in sizes.items() if s) + ")" if known else ""
    lines = [f"memory per GPU{of}:"]
    for name, roles in memory.items():
        for role, est in roles.items():
            parts = ", ".join(f"{k} {fmt(v)}" for k, v in est.parts.items() if v)
            inside = f" in {est.inside}'s ranks" if est.inside else ""
            lines.append(
                f"  {name} ({role}{inside}): {fmt(est.gpu_bytes)} ({parts}); "
                f"host {fmt(est.host_bytes)}"
            )
    lines.append("host memory per node:")
    for name, roles in memory.items():
        for node in dict.fromkeys(n for est in roles.values() for n in est.nodes):
            held = [(r, e.nodes[node], e.host_bytes) for r, e in roles.items() if node in e.nodes]
            total = sum(k * b for _, k, b in held)
            shown = ", ".join(f"{r} {k} x {fmt(b)}" for r, k, b in held)
            have = cluster.host_memory(node)
            of_node = f" of {fmt(have)}" if have else ""
            lines.append(f"  {name} on {node}: {fmt(total)}{of_node} ({shown})")
    return lines
