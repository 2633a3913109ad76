"""Plan a pipeline without running it: file -> `Plan`, for `pipe validate` and `pipe plan`.

Input: a pipeline file, `--set` overrides, and maybe a declared cluster (`--cluster`: a file
or a shorthand such as 6x8x80GB). Output: the `Plan` (load -> resolve -> plan), placed on
the declared cluster when one is given, with `cluster.gpus: auto` read from it or from this
machine; its warnings and notes go to stderr.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from engine.plan.dag import Plan


def view_gpus(declared: Any, view: Any) -> int | None:
    """`cluster.gpus: auto` planned against a declared cluster takes the cluster's GPUs."""
    if declared == "auto" and view is not None:
        return len(view.devices())
    return None


def auto_gpus(loaded: Any, view: Any, cluster: str | None) -> tuple[int | None, str, Any]:
    """`cluster.gpus: auto` without a live cluster: a declared `--cluster`'s GPUs, else, for
    the embedded cluster (`scheduler: local`), the GPUs `pipe run` will give its workers
    (visible on this machine, read without torch) and that machine as the cluster placed on;
    a remote scheduler's are known once connected. Returns (gpus, where from, view)."""
    from engine.cluster.connect import local_gpus, scheduler_address

    spec = loaded.spec.cluster
    if spec.gpus != "auto":
        return None, "", view
    if view is not None:
        return view_gpus(spec.gpus, view), f"from --cluster {cluster}", view
    if scheduler_address(None, spec.scheduler) != "local":
        return None, "", None
    return local_gpus(spec.gpus_per_node)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Load, resolve and plan make some 10^5 small objects with no cycles among them; the
    cyclic collector rescanning them took about half of a 1,000-stage `pipe validate`
    (BENCHMARKS.md). Paused for that bounded work, on again after it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def build_plan(
    path: str,
    overrides: tuple[str, ...] = (),
    run_dir: str | None = None,
    notes: bool = True,
    cluster: str | None = None,
    network: bool = True,
) -> Plan:
    """load -> resolve -> plan (placed on a declared `cluster` when given); warnings and notes
    go to stderr (unless `notes` is off). `network` off (`pipe validate`): hub ids are pinned
    from the local cache only, the hub is never asked."""
    from engine.load.load import load_pipeline
    from engine.plan.dag import plan
    from engine.resolve.pins import Pinning
    from engine.resolve.resolve import resolve

    view = None
    if cluster is not None:
        from engine.plan.topology_file import load_cluster_file

        view = load_cluster_file(cluster)
    with _gc_paused():
        loaded = load_pipeline(path, overrides)
        gpus, source, view = auto_gpus(loaded, view, cluster)
        pinning = Pinning(network=network)
        resolved = resolve(loaded, run_dir=run_dir, gpus=gpus, gpus_from=source, pinning=pinning)
        result = plan(resolved, view)
    for note in result.resolved.notes if notes else ():
        click.echo(note.render(), err=True)
    return result
