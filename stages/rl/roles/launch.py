"""Where an rl stage's ranked roles (actor, critic, ref, teacher, reward) run and how they
are started.

Input: the stage's context (its slots: which workers hold each role's devices), its
config and folder. Output: each role's ranks started as one torch.distributed job across
the workers the placement gives it: the controller's task starts the ranks on its own
worker (a thread follows them) and publishes the role's brief path for the tasks on the
role's other workers (`stages.rl.controller.remote`), which start theirs; the role's rank 0 then
connects to the controller. Each rank records what it was given in
`<stage>/ranks/<role>-<rank>.json` (`records_of`).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from stages.rl.roles.channel import ActorGone
from stages.rl.roles.layout import local_ranks, rendezvous, role_table, role_workers, worker_host

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.lib.distributed.spawn import Ranks
    from stages.rl import RLConfig


def host_of(ctx: StageContext) -> str:
    """Where the roles and engines on other workers reach the controller: its worker's
    host (127.0.0.1 for a stage without placement)."""
    return worker_host(ctx.tasks[0][1] if ctx.tasks else None)


def start_ranks(
    cfg: RLConfig,
    ctx: StageContext,
    role: str,
    brief_path: str,
    ranks: Ranks,
    errors: list[BaseException],
    should_stop: Callable[[], str | None] | None = None,
) -> threading.Thread:
    """Start this task's ranks of `role` (`python -m stages.rl.<role>`) in a thread that
    meets the role's other tasks at its rendezvous and follows the ranks; a failure lands
    in `errors`."""
    import torch

    from stages.lib.distributed.spawn import launch

    device = "cuda" if ranks.devices and torch.cuda.is_available() else "cpu"
    stage_dir = ctx.stage_dir.rstrip("/")
    suffix = f".{ranks.node_rank}" if ranks.node_rank else ""

    def follow() -> None:
        try:
            launch(
                f"stages.rl.roles.{role}",
                brief_path,
                rendezvous(ctx, role, ranks),
                device,
                cfg.threads,
                f"{stage_dir}/{role}_log{suffix}.txt",
                ctx.log,
                should_stop=should_stop,
            )
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=follow, name=f"rl-{role}", daemon=True)
    thread.start()
    return thread


class Roles:
    """The trained roles of one stage: started, followed, their errors kept."""

    def __init__(self, cfg: RLConfig, ctx: StageContext, stage_dir: str) -> None:
        self.cfg, self.ctx, self.dir = cfg, ctx, stage_dir
        self.errors: list[BaseException] = []

    def start(self, role: str, brief: Any, end: Any) -> threading.Thread | None:
        """Write the role's brief, start its ranks on this worker (if it has any here) and
        publish the brief for its other workers; then wait for its rank 0 to connect."""
        path = f"{self.dir}/{role}_brief.json"
        brief.write(path)
        if any(w != self.ctx.tasks[0][1] for w in role_workers(self.ctx, role)):
            assert self.ctx.link is not None
            self.ctx.link.publish(f"brief-{role}", path)
        ranks = local_ranks(self.ctx, role, self.cfg.num_processes)
        thread = None
        if ranks is not None:
            thread = start_ranks(self.cfg, self.ctx, role, path, ranks, self.errors)
        alive = thread.is_alive if thread is not None else self.remote_alive
        try:
            end.accept(alive, timeout_s=600)
        except ActorGone:
            if thread is not None:  # the ranks' own failure (exit status, their log's last
                thread.join(timeout=30)  # lines) says why; "exited before connecting" does not
            if self.errors:
                raise self.errors[0] from None
            raise
        return thread

    def remote_alive(self) -> bool:
        return self.ctx.link is None or self.ctx.link.aborted() is None

    def devices(self, role: str) -> tuple[Literal["cpu", "cuda"], int, tuple[str, ...]]:
        """Device kind, ranks of `role` (its devices on every worker) and, here, their
        CUDA_VISIBLE_DEVICES names."""
        table = role_table(self.ctx, role)
        if not table:
            return "cpu", self.cfg.num_processes, ()
        import torch

        names = self.ctx.device_env(role).get("CUDA_VISIBLE_DEVICES", "")
        device: Literal["cpu", "cuda"] = "cuda" if torch.cuda.is_available() else "cpu"
        return device, len(table), tuple(names.split(",")) if names else ()

    def records(self) -> dict[str, list[dict[str, Any]]]:
        """What every rank of each trained role recorded it was given (rank, world size,
        node, worker, ...)."""
        roles = ("actor", "critic", "ref", "teacher", "reward")
        found = {role: records_of(self.dir, role) for role in roles}
        return {role: recs for role, recs in found.items() if recs}


def record_rank(stage_dir: str, role: str, rank: int, world: int, device: str) -> None:
    """A rank's own record of what it was given: `<stage_dir>/ranks/<role>-<rank>.json`."""
    import socket

    from stages.lib.io.jsonl import write_json

    env = os.environ
    write_json(
        f"{stage_dir}/ranks/{role}-{rank}.json",
        {
            "rank": rank,
            "world_size": world,
            "local_rank": int(env.get("LOCAL_RANK", "0")),
            "node_rank": int(env.get("NODE_RANK", "0")),
            "node": env.get("PIPE_NODE") or socket.gethostname(),
            "worker": env.get("PIPE_WORKER", "local"),
            "device": device,
            "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
            "master": f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}",
            "pid": os.getpid(),
        },
    )


def records_of(stage_dir: str, role: str) -> list[dict[str, Any]]:
    """The records of `role`'s ranks, by rank (rank, world_size, node, worker and more)."""
    folder = f"{stage_dir}/ranks"
    out = []
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    for name in names:
        if name.startswith(f"{role}-") and name.endswith(".json"):
            with open(f"{folder}/{name}", encoding="utf-8") as f:
                out.append(json.load(f))
    return sorted(out, key=lambda r: int(r["rank"]))
