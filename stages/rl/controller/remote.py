"""A task of an rl stage on another worker than the controller's: it starts this worker's
share of every role placed here (the actor's, critic's, reference's, teacher's and reward
model's ranks; an engine when the `vllm` role holds devices here) and follows them.

Input: the stage's context (this task's slots, and the link to the controller's task,
which publishes each role's brief file and each engine's brief). Output: the roles' ranks
and the engine run until the controller stops them; a failure raises the stage's abort
flag (run_stage does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.rl import RLConfig

BRIEF_TIMEOUT_S = 900.0
TRAINED = ("actor", "critic", "ref", "teacher", "reward")
FROZEN = ("ref", "teacher")


def host_roles(cfg: RLConfig, ctx: StageContext) -> dict[str, Any]:
    """Start every role placed on this worker; return when all of them have exited."""
    from stages.rl.roles.frozen import in_actor
    from stages.rl.roles.launch import start_ranks
    from stages.rl.roles.layout import local_ranks
    from stages.rl.rollout.pool import host_engine, spawn

    assert ctx.link is not None
    link = ctx.link
    errors: list[BaseException] = []
    threads = []
    roles = []
    # the frozen roles' own ranks: used, on devices of their own (else the actor's ranks load them)
    used = {"ref": cfg.kl_coef > 0, "teacher": cfg.teacher is not None}
    own = {role: used[role] and not in_actor(ctx.slots, role) for role in FROZEN}
    for role in TRAINED:
        ranks = local_ranks(ctx, role, cfg.num_processes)
        if ranks is None or not own.get(role, True):
            continue
        path = link.lookup(f"brief-{role}", timeout_s=BRIEF_TIMEOUT_S)
        threads.append(start_ranks(cfg, ctx, role, path, ranks, errors, link.aborted))
        roles.append(role)
    if ctx.node_slots("vllm"):
        if cfg.backend.RL_ENGINE == "servers":
            from stages.rl.rollout.vllm_servers import host_servers

            threads.append(spawn(lambda: host_servers(cfg, ctx), "rl-vllm", errors))
        else:
            threads.append(spawn(lambda: host_engine(cfg, ctx), "rl-engine", errors))
        roles.append("vllm")
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return {"node_rank": ctx.node_rank, "roles": roles}
