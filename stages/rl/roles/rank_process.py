"""The body of an rl rank process (actor, critic, ref): `python -m stages.rl.roles.ROLE BRIEF`.

Input: the `ActorBrief` path on the command line and the rank in the environment (set by
`stages.lib.distributed.spawn`). Output: the rank set up (logging, threads, device, process group),
its record in `<stage>/ranks/` (`stages.rl.roles.launch.record_rank`), the role built, and
the stage's requests answered in order until `stop`: rank 0 receives each and passes it on
to the other ranks (through the rendezvous store, not a collective: they may wait for hours,
`stages.lib.distributed.serve`), every rank runs it, rank 0 replies on the role's channel.
A frozen role's ranks each score every world-th item of a request, and rank 0 answers with
them all in order (`gather_shares`).
"""

from __future__ import annotations

import logging
import os
import random
import sys
from typing import Any

from stages.lib.distributed.rank import die_with_parent, leave_group, start_rank


def serve_with(handlers: dict[str, Any], world: int, conn: Any) -> None:
    """Answer requests with `handlers` until `stop`: rank 0 receives each and passes it on
    to the other ranks (through the store, not a collective: `stages.lib.distributed.serve`),
    every rank runs it, rank 0 replies."""
    from stages.lib.distributed.serve import Requests

    requests = Requests(world, conn)
    while True:
        kind, payload = requests.next()
        if kind == "stop":
            requests.read_by_all()
            if conn is not None:
                conn.send(("ok", None))
            return
        try:
            reply = handlers[kind](payload)
        except Exception as exc:
            if conn is not None:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            raise
        if conn is not None:
            conn.send(("ok", reply))


def log_placed(logger: logging.Logger, what: str, rank: int, world: int, kind: str) -> None:
    """The line saying where a rank of `what` runs, and as what."""
    logger.info(
        "%s on node %s (CUDA_VISIBLE_DEVICES %s), rank %d of %d, %s",
        what,
        os.environ.get("PIPE_NODE", "-"),
        os.environ.get("CUDA_VISIBLE_DEVICES", "-"),
        rank,
        world,
        kind,
    )


def gather_shares(mine: list[Any], total: int, rank: int, world: int) -> list[Any] | None:
    """Each rank's share of `total` items (every world-th from its rank: `items[rank::world]`)
    gathered back in order: the whole list on rank 0, None on the others. Under NCCL the
    objects travel on torch.cuda.current_device(), which the caller must set
    (torch/distributed/distributed_c10d.py, all_gather_object): run_role does."""
    if world == 1:
        return mine
    import torch.distributed as dist

    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    out: list[Any] = [None] * total
    for r, part in enumerate(parts):
        out[r::world] = part
    return out if rank == 0 else None


def run_role(
    argv: list[str] | None, logger: logging.Logger, build: Any, handlers: Any, seed_offset: int = 0
) -> int:
    """The body of an rl rank process (actor or critic): read the brief, set up the rank and
    its process group, `build(brief, rank, world, device)` the role, answer requests with
    `handlers(role)` until `stop`."""
    import torch

    from stages.rl.roles.brief import ActorBrief
    from stages.rl.roles.channel import connect

    args = sys.argv[1:] if argv is None else argv
    die_with_parent()
    brief = ActorBrief.read(args[0])
    rank, world, device = start_rank(brief)
    from stages.rl.roles.launch import record_rank

    record_rank(brief.stage_dir, os.environ.get("PIPE_ROLE", "actor"), rank, world, device)
    random.seed(brief.config.seed + seed_offset)
    torch.manual_seed(brief.config.seed + seed_offset)
    role = build(brief, rank, world, device)
    conn = connect(brief.channel, brief.authkey) if rank == 0 else None
    what = role.trainer.name if hasattr(role, "trainer") else role.kind
    logger.info("ready: %d rank(s), %s, %s", world, what, device)
    serve_with(handlers(role), world, conn)
    leave_group()
    return 0
