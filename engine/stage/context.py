"""The run side of the stage API: what a running stage knows about its place in the run.

Input: what the engine's task hands a stage when it starts (its folders, attempt, and the
slots of its placement: `Slot`, one per node, worker and role). Output: the `StageContext`
a kind's body reads (its devices, `CUDA_VISIBLE_DEVICES` for the processes it starts, the
`NodeLink` between the tasks of a stage that spans nodes), and `at_stage_end`, through which
stage code has memory released when the stage ends.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Slot:
    """Devices a stage holds on one worker of one node, for one role (or the whole stage)."""

    node: str
    worker: str | None
    devices: tuple[int, ...]
    role: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "worker": self.worker,
            "devices": list(self.devices),
            "role": self.role,
        }


DATE_ENV = "PIPE_DATE"  # the run's date for the processes a stage starts

# what stage code registered to release when the stage running in this process ends
STAGE_END: list[Callable[[], None]] = []


def at_stage_end(release: Callable[[], None]) -> None:
    """Run `release` at the end of every stage in this worker process from now on (e.g. a
    cache of models on a GPU: the next stage there may need that memory)."""
    if release not in STAGE_END:
        STAGE_END.append(release)


class NodeLink(Protocol):
    """How the tasks of a stage that spans nodes reach each other (Dask variables)."""

    def publish(self, key: str, value: str) -> None: ...
    def lookup(self, key: str, timeout_s: float) -> str: ...
    def abort(self, reason: str) -> None: ...
    def aborted(self) -> str | None: ...


@dataclass
class StageContext:
    """What a running stage knows about its place in the run.

    By the time a stage function runs, its config is fully resolved: input fields
    hold absolute paths (or URLs), `@stage` references are replaced by the paths
    they name, and output fields are absolute paths inside `stage_dir`. The stage
    returns a JSON-serialisable dict of metrics; the engine writes it to
    `<stage_dir>/metrics.json` and puts it in the run report.
    """

    name: str
    kind: str
    stage_dir: str
    run_dir: str
    pipeline_dir: str
    attempt: int = 1
    gpus: int = 0
    workers: int = 1
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("pipe.stage"))
    slots: tuple[Slot, ...] = ()  # every slot of the stage, on every node, in node order
    node_rank: int = 0  # which of the stage's nodes this task runs on
    link: NodeLink | None = None  # set when the stage spans nodes
    # every output path of the run's stages (absolute) -> the reference naming it, without
    # '@' (`sft`, `data.test_output`): which stage made an input the config holds as a path;
    # and the snapshot folder of each hub model it reads -> its hub id (`org/name`)
    producers: Mapping[str, str] = field(default_factory=dict)
    # the run's date, ISO: the day chat templates that read the clock render (the processes
    # the stage starts find it in `PIPE_DATE`); empty outside a run
    date: str = ""

    def path(self, name: str) -> str:
        """A file inside this stage's folder."""
        return f"{self.stage_dir.rstrip('/')}/{name}"

    @property
    def tasks(self) -> tuple[tuple[str, str | None], ...]:
        """The stage's (node, worker) pairs in rank order: one Dask task each."""
        return tuple(dict.fromkeys((s.node, s.worker) for s in self.slots))

    def node_slots(self, role: str | None = None) -> tuple[Slot, ...]:
        """This task's slots (its node and worker), of `role` when given."""
        if not self.slots:
            return ()
        here = self.tasks[self.node_rank]
        return tuple(
            s for s in self.slots if (s.node, s.worker) == here and (role is None or s.role == role)
        )

    def devices(self, role: str | None = None) -> tuple[int, ...]:
        """Device ids this task holds (of `role` when given); empty on a CPU stage."""
        return tuple(sorted({d for s in self.node_slots(role) for d in s.devices}))

    def device_env(self, role: str | None = None) -> dict[str, str]:
        """`CUDA_VISIBLE_DEVICES` for a process this task starts: its devices, as this worker
        names them; nothing on a CPU stage (the environment is left as it is)."""
        ids = self.devices(role)
        return {"CUDA_VISIBLE_DEVICES": ",".join(visible_names(ids))} if ids else {}


def visible_names(ids: Sequence[int]) -> list[str]:
    """How device ids read in `CUDA_VISIBLE_DEVICES`: the worker's own entries when it has a
    list of names that are not the ids themselves (e.g. GPU UUIDs), else the ids."""
    own = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if own and not all(d.isdigit() for d in own):
        return [own[i] if i < len(own) else str(i) for i in ids]
    return [str(i) for i in ids]
