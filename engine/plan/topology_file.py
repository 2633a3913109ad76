"""Plan, part of: a declared cluster, read from a file to plan against without one
(`--cluster C.yaml`).

Input: a YAML file, or a shorthand `NODESxGPUS[xMEMGB]` (`6x8`, `6x8x80GB`).
Output: a `ClusterView` of declared nodes (`node0`, `node1`, ... unless named),
one worker each with devices 0..gpus-1, no address, and the node's own GPU and host
memory (a node's figure, else the file's top-level one); errors located like
the pipeline file's (`file:line:col: path: message`).

    nodes: 6            # or a list: [{name: a, gpus: 8, gpu_memory_gb: 40, host_memory_gb: 512}]
    gpus_per_node: 8
    gpu_memory_gb: 80
    host_memory_gb: 1024
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import Diagnostic, Location, PipeError
from engine.load.source import load_document
from engine.load.validation import validation_diagnostics
from engine.plan.topology import ClusterView, Worker

GB = 10**9
_SHORT = re.compile(r"^(\d+)x(\d+)(?:x(\d+(?:\.\d+)?)GB)?$", re.IGNORECASE)


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class DeclaredNode(_Block):
    """One node of a declared cluster."""

    name: str | None = Field(None, description="The node's name (default node<i>).")
    gpus: int | None = Field(None, ge=0, description="GPUs of this node (default gpus_per_node).")
    gpu_memory_gb: float | None = Field(None, gt=0, description="Memory of each GPU, in GB.")
    host_memory_gb: float | None = Field(None, gt=0, description="Host memory, in GB.")


class ClusterFile(_Block):
    """A cluster described for planning: nodes, GPUs per node, memory."""

    nodes: int | list[DeclaredNode] = Field(description="How many nodes, or each node's figures.")
    gpus_per_node: int = Field(8, gt=0, description="GPUs of a node.")
    gpu_memory_gb: float | None = Field(None, gt=0, description="Memory of each GPU, in GB.")
    host_memory_gb: float | None = Field(None, gt=0, description="Host memory of a node, in GB.")


def load_cluster_file(source: str) -> ClusterView:
    """The declared cluster of a file or a shorthand; `PipeError` with located messages."""
    short = _SHORT.match(source.strip())
    if short and not Path(source).exists():
        nodes, gpus, mem = int(short[1]), int(short[2]), short[3]
        declared = ClusterFile(
            nodes=nodes, gpus_per_node=gpus, gpu_memory_gb=float(mem) if mem else None
        )
        return _view(declared)
    if not Path(source).is_file():
        raise PipeError.single(
            Location(f"--cluster {source}"),
            "",
            "no such file, and not a shorthand such as 6x8 or 6x8x80GB (nodes x GPUs x GPU memory)",
        )
    doc = load_document(source)
    if not isinstance(doc.data, dict):
        raise PipeError.single(doc.value_loc(()), "", "expected a mapping of cluster settings")
    try:
        declared = ClusterFile.model_validate(doc.data)
    except ValidationError as exc:
        raise PipeError(validation_diagnostics(exc, doc, (), doc.data, ClusterFile)) from None
    errors = []
    if isinstance(declared.nodes, list):
        for i, node in enumerate(declared.nodes):
            if node.gpus is not None and node.gpus > declared.gpus_per_node:
                errors.append(
                    Diagnostic(
                        doc.value_loc(("nodes", i, "gpus")),
                        f"nodes[{i}].gpus",
                        f"{node.gpus} GPUs on a node of at most {declared.gpus_per_node} "
                        "(gpus_per_node)",
                    )
                )
    if errors:
        raise PipeError(errors)
    return _view(declared)


def _view(declared: ClusterFile) -> ClusterView:
    """One worker per node, each with its own figures (a node's own, else the file's)."""
    nodes = (
        declared.nodes
        if isinstance(declared.nodes, list)
        else [DeclaredNode() for _ in range(declared.nodes)]
    )
    workers = tuple(
        Worker(
            None,
            n.name or f"node{i}",
            tuple(range(declared.gpus_per_node if n.gpus is None else n.gpus)),
            _bytes(n.gpu_memory_gb if n.gpu_memory_gb is not None else declared.gpu_memory_gb),
            _bytes(n.host_memory_gb if n.host_memory_gb is not None else declared.host_memory_gb),
        )
        for i, n in enumerate(nodes)
    )
    return ClusterView(
        workers,
        declared.gpus_per_node,
        _bytes(declared.gpu_memory_gb),
        _bytes(declared.host_memory_gb),
    )


def _bytes(gb: float | None) -> int | None:
    return int(gb * GB) if gb else None
