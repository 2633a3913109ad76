"""The rl stage's body: the controller on the stage's first task, the roles' share elsewhere.

Input: a resolved `RLConfig` and the `StageContext`. Output: what the controller's run
returns (`stages.rl.controller.core`), or on another worker's task what `host_roles`
returns once the ranks and engines placed there have ended.
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
    if ctx.node_rank > 0:
        from stages.rl.controller.remote import host_roles

        return host_roles(cfg, ctx)
    from stages.rl.controller.core import Controller
    from stages.rl.controller.start import start

    controller = Controller(cfg, ctx)
    began = time.perf_counter()
    try:
        return controller.run(start(controller), began)
    finally:
        controller.close()
