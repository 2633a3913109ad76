"""Render a pipeline's stage graph as text, Mermaid or Graphviz dot."""

from __future__ import annotations

from engine.schema import PipelineSpec


def topological(spec: PipelineSpec) -> list[str]:
    """Stage names, each after everything it needs; ties keep file order."""
    import networkx as nx

    graph = nx.DiGraph()
    graph.add_nodes_from(spec.stages)
    for name, st in spec.stages.items():
        graph.add_edges_from((need, name) for need in st.needs)
    order = {name: i for i, name in enumerate(spec.stages)}
    return list(nx.lexicographical_topological_sort(graph, key=order.__getitem__))


def render_graph(spec: PipelineSpec, fmt: str) -> str:
    names = topological(spec)
    if fmt == "mermaid":
        lines = ["flowchart TD"]
        lines += [f'  {n}["{n} ({spec.stages[n].kind})"]' for n in names]
        lines += [f"  {need} --> {n}" for n in names for need in spec.stages[n].needs]
        return "\n".join(lines) + "\n"
    if fmt == "dot":
        lines = [f'digraph "{spec.name}" {{', "  rankdir=LR;"]
        lines += [f'  "{n}" [label="{n}\\n({spec.stages[n].kind})"];' for n in names]
        lines += [f'  "{need}" -> "{n}";' for n in names for need in spec.stages[n].needs]
        return "\n".join([*lines, "}"]) + "\n"
    out = []
    for n in names:
        needs = spec.stages[n].needs
        after = f" <- {', '.join(needs)}" if needs else ""
        out.append(f"{n} ({spec.stages[n].kind}){after}")
    return "\n".join(out) + "\n"
