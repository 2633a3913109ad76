"""Plan, part of: the cluster placement works with, declared or live.

Input: a declared cluster's nodes (`engine.plan.topology_file`) or what the live Dask workers
report (`view_from_workers`: resources, environment, memory figures). Output: a
`ClusterView`: workers on nodes with their device ids and memory figures, and what a
node or a worker offers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

Device = tuple[str, str | None, int]  # (node, worker, device id)

log = logging.getLogger("pipe.placement")


@dataclass(frozen=True)
class Worker:
    """A Dask worker (or a declared node): where it runs, the devices it holds, and its own
    memory figures (None: the cluster's, if any)."""

    address: str | None
    node: str
    devices: tuple[int, ...]
    gpu_memory_bytes: int | None = None  # each of its GPUs
    host_memory_bytes: int | None = None  # its host (shared with the node's other workers)


@dataclass(frozen=True)
class ClusterView:
    """The cluster placement works with; `gpu_memory_bytes`/`host_memory_bytes` are the
    figures of a worker that gives none of its own (None: unknown, not checked)."""

    workers: tuple[Worker, ...]
    gpus_per_node: int
    gpu_memory_bytes: int | None = None
    host_memory_bytes: int | None = None

    def nodes(self) -> list[str]:
        return list(dict.fromkeys(w.node for w in self.workers))

    def gpu_memory(self, node: str, worker: str | None) -> int | None:
        """The memory of each GPU of the worker at `worker` on `node` (a declared node: its
        one worker, address None)."""
        for w in self.workers:
            if w.node == node and w.address == worker and w.gpu_memory_bytes is not None:
                return w.gpu_memory_bytes
        return self.gpu_memory_bytes

    def host_memory(self, node: str) -> int | None:
        """The host memory of `node`: the smallest its workers report (they share the host)."""
        own = [
            w.host_memory_bytes
            for w in self.workers
            if w.node == node and w.host_memory_bytes is not None
        ]
        return min(own) if own else self.host_memory_bytes

    def grown(self, k: int) -> ClusterView:
        """This cluster with its nodes k times over (copies named `<node>+<i>`, no address):
        what a bigger cluster of the same nodes would offer."""
        copies = tuple(
            replace(w, address=None, node=f"{w.node}+{i}")
            for i in range(1, k)
            for w in self.workers
        )
        return replace(self, workers=self.workers + copies)

    def gpu_memory_by_node(self) -> dict[str, int | None]:
        """Each node's smallest GPU (None: unknown)."""
        out: dict[str, int | None] = {}
        for node in self.nodes():
            sizes = [self.gpu_memory(node, w.address) for w in self.workers if w.node == node]
            known = [s for s in sizes if s is not None]
            out[node] = min(known) if known else None
        return out

    def devices(self) -> list[Device]:
        """Every usable device in order: node, worker, id; at most gpus_per_node a node."""
        out: list[Device] = []
        for node in self.nodes():
            here = [(node, w.address, d) for w in self.workers if w.node == node for d in w.devices]
            out.extend(here[: self.gpus_per_node])
        return out

    def describe(self) -> str:
        counts = [sum(1 for d in self.devices() if d[0] == n) for n in self.nodes()]
        if counts and len(set(counts)) == 1:
            return f"{len(counts)} node(s) x {counts[0]}"
        return ", ".join(f"{n}: {c}" for n, c in zip(self.nodes(), counts, strict=True))


def view_from_workers(info: Mapping[str, Mapping[str, Any]], gpus_per_node: int) -> ClusterView:
    """The live cluster: `{address: {"host", "resources", "env"}}` from the Dask workers.

    A worker's node is its `PIPE_NODE` environment variable, else its host; its device ids
    the first `GPU` integer entries of its `CUDA_VISIBLE_DEVICES`, else 0..GPU-1; its GPU
    memory the `GPU_MEMORY_MIB` it reports (nvidia-smi), its host memory `HOST_MEMORY_BYTES`.
    A figure a worker cannot read stays None: not checked, never guessed (logged at debug).
    """
    workers = []
    for address, w in info.items():
        env = w.get("env") or {}
        count = int((w.get("resources") or {}).get("GPU", 0))
        visible = [
            d.strip() for d in (env.get("CUDA_VISIBLE_DEVICES") or "").split(",") if d.strip()
        ]
        if len(visible) >= count and all(d.isdigit() for d in visible[:count]):
            ids = tuple(int(d) for d in visible[:count])
        else:
            ids = tuple(range(count))
        node = env.get("PIPE_NODE") or str(w.get("host") or address)
        gpu_mib = _figure(env, "GPU_MEMORY_MIB", address, "GPU memory (nvidia-smi)", count > 0)
        host = _figure(env, "HOST_MEMORY_BYTES", address, "host memory", True)
        gpu = gpu_mib * 2**20 if gpu_mib is not None else None
        workers.append(Worker(address, node, ids, gpu, host))
    workers.sort(key=lambda w: (w.node, w.address or ""))
    return ClusterView(tuple(workers), gpus_per_node)


def _figure(env: Mapping[str, Any], key: str, address: str, what: str, wanted: bool) -> int | None:
    """A worker's memory figure from its environment report; None (logged) when unreadable."""
    value = str(env.get(key) or "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    if wanted:
        log.debug("worker %s: its %s could not be read; it is not checked", address, what)
    return None
