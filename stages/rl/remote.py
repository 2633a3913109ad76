"""A task of an rl stage on another worker than the controller's: it starts the ranks of
the roles placed on its worker (the actor, the critic, the reference's own ranks) and
follows them.

Input: the stage's context (this task's slots, and the link to the controller's task,
which publishes each role's spec file). Output: the roles' ranks run until the
controller stops them; a failure raises the stage's abort flag (run_stage does).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.rl import RLConfig

SPEC_TIMEOUT_S = 900.0


def host_roles(cfg: RLConfig, ctx: StageContext) -> dict[str, Any]:
    """Start every role placed on this worker; return when all of them have exited."""
    from stages.lib.launch import Ranks, launch

    assert ctx.link is not None
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    from stages.rl.reference import in_actor

    alone = {"actor", "critic"} | (
        {"ref"} if cfg.kl_coef > 0 and not in_actor(ctx.slots) else set()
    )
    roles = [r for r in ("actor", "critic", "ref") if r in alone and ctx.node_slots(r)]
    errors: list[BaseException] = []
    threads = []
    for role in roles:
        path = ctx.link.lookup(f"spec-{role}", timeout_s=SPEC_TIMEOUT_S)
        names = ctx.device_env(role).get("CUDA_VISIBLE_DEVICES", "")
        world = len(ctx.devices(role))

        def follow(
            role: str = role, path: str = path, names: str = names, world: int = world
        ) -> None:
            try:
                launch(
                    f"stages.rl.{role}",
                    path,
                    Ranks(world=world, devices=tuple(names.split(",")) if names else ()),
                    device,
                    cfg.num_threads,
                    f"{ctx.stage_dir.rstrip('/')}/{role}_log.txt",
                    ctx.log,
                    should_stop=ctx.link.aborted if ctx.link is not None else None,
                )
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=follow, name=f"rl-{role}", daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return {"node_rank": ctx.node_rank, "roles": roles}
