"""The rl stage's body: the controller on the stage's first task, the roles' share elsewhere.

Input: a resolved `RLConfig` and the `StageContext`. Output: what the controller's run
returns (`stages.rl.controller.core`), or on another worker's task what `host_roles`
returns once the ranks and engines placed there have ended. `num_threads: auto` becomes a
count here, on each task, before anything reads it (`with_threads`); the engine's block
already holds `micro_rollout_batch_size`, derived by the plan
(`stages.lib.backends.rollout_batch`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.rl import RLConfig


def run_rl(cfg: RLConfig, ctx: StageContext) -> dict[str, Any]:
    """Run the stage. Its first task is the controller (with the engine); a task on another
    worker starts the ranks of the roles placed there."""
    cfg, threads_how = with_threads(cfg, ctx)
    ctx.log.info("num_threads: %d (%s)", cfg.threads, threads_how)
    if ctx.node_rank > 0:
        from stages.rl.controller.remote import host_roles

        return host_roles(cfg, ctx)
    from stages.rl.controller.core import Controller
    from stages.rl.controller.start import start

    controller = Controller(cfg, ctx, threads_how)
    began = time.perf_counter()
    try:
        return controller.run(start(controller), began)
    finally:
        controller.close()


def with_threads(cfg: RLConfig, ctx: StageContext) -> tuple[RLConfig, str]:
    """`cfg` with `num_threads` a count, and how it was chosen: `auto` shares the cores the
    cluster's other Dask workers on this host leave free (`stages.lib.devices.free_cores`)
    among the processes that compute at once: the actor's ranks, the critic's beside them
    (ppo), and the engine generating beside the update under `async_train` with a queue. In a
    synchronous step (and with `async_queue_size: 0`) the engine and the actor take turns, so
    each gets the whole share."""
    if cfg.num_threads != "auto":
        return cfg, "set in the config"
    from stages.lib.devices import free_cores

    cores, counted = free_cores(ctx)
    ranks = len(ctx.devices("actor")) or cfg.num_processes  # the actor's ranks on this node
    beside = cfg.async_train and cfg.async_queue_size > 0  # queue 0 takes turns, as sync
    busy = ranks * (2 if cfg.algorithm == "ppo" else 1) + (1 if beside else 0)
    threads = max(1, cores // busy)
    how = f"auto: {cores} free core(s) ({counted}) over {busy} process(es) computing at once"
    return cfg.model_copy(update={"num_threads": threads}), how
