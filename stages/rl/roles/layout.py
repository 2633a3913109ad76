"""Where the ranks of an rl role run, and where they meet.

Input: the stage's context (every slot of every role, the tasks in order, this task's
node rank, the link between the tasks). Output: a role's rank table (one entry per rank:
global rank, the role's node rank, local rank, node, worker, device), numbered task by
task as the train stage numbers its ranks; the `Ranks` this task starts for the role;
and the role's rendezvous: on one worker its ranks meet on 127.0.0.1, across workers on
the reachable address of the worker holding the role's rank 0, picked by the task there
and published through the link (`master-<role>`) for the role's other tasks.

A role without devices (a CPU run) has `num_processes` ranks on the controller's worker.
"""

from __future__ import annotations

import socket
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.lib.distributed.spawn import Ranks

MASTER_TIMEOUT_S = 900.0


def worker_host(worker: str | None) -> str:
    """The host of a Dask worker's address (`tcp://10.0.0.5:4242` -> `10.0.0.5`)."""
    if not worker:
        return "127.0.0.1"
    return worker.split("://")[-1].rsplit(":", 1)[0].strip("[]")


def role_table(ctx: StageContext, role: str) -> list[dict[str, Any]]:
    """Every rank of `role`: one per device the placement gives it, task by task."""
    from stages.lib.distributed.spawn import rank_table

    return rank_table(ctx, role)


def role_workers(ctx: StageContext, role: str) -> list[str | None]:
    """The workers holding `role`, in task order."""
    return list(dict.fromkeys(r["worker"] for r in role_table(ctx, role)))


def local_ranks(ctx: StageContext, role: str, num_processes: int) -> Ranks | None:
    """The ranks of `role` this task starts (None: none here), rendezvous not yet set."""
    from stages.lib.distributed.spawn import Ranks

    table = role_table(ctx, role)
    here = ctx.tasks[ctx.node_rank] if ctx.tasks else (None, None)
    env = (
        ("PIPE_ROLE", role),
        ("PIPE_WORKER", str(here[1] or "local")),
        *((("PIPE_NODE", str(here[0])),) if here[0] else ()),
    )
    if not table:
        return Ranks(world=num_processes, env=env) if ctx.node_rank == 0 else None
    mine = [r for r in table if (r["node"], r["worker"]) == here]
    if not mine:
        return None
    names = ctx.device_env(role).get("CUDA_VISIBLE_DEVICES", "")
    return Ranks(
        world=len(table),
        first=mine[0]["rank"],
        local=len(mine),
        node_rank=mine[0]["node_rank"],
        devices=tuple(names.split(",")) if names else (),
        env=env,
    )


def rendezvous(ctx: StageContext, role: str, ranks: Ranks) -> Ranks:
    """`ranks` with the address of the role's rank 0: 127.0.0.1 and a free port when the
    whole role is on this worker; across workers, the task holding rank 0 binds a free port
    on its worker's reachable host and publishes it, the others look it up."""
    if ranks.count == ranks.world:
        return ranks
    assert ctx.link is not None, "a role across workers needs the stage's link"
    if ranks.first == 0:
        host = worker_host(ctx.tasks[ctx.node_rank][1])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        ctx.link.publish(f"master-{role}", f"{host}:{port}")
    else:
        found = ctx.link.lookup(f"master-{role}", timeout_s=MASTER_TIMEOUT_S)
        host, text = found.rsplit(":", 1)
        port = int(text)
    return replace(ranks, master_addr=host, master_port=port)
