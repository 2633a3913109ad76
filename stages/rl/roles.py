"""Where an rl stage's trained roles (actor, critic) run and how they are started.

Input: the stage's context (its slots: which worker holds each role's devices), its
config and folder. Output: each role's ranks started here (a thread follows them) when
its devices are on the controller's worker or there are none, or else its spec path
published for the task on its worker (`stages.rl.remote`); the role's device kind, rank
count and `CUDA_VISIBLE_DEVICES`; and whether the ranks are still alive.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.rl import RLConfig


def host_of(ctx: StageContext) -> str:
    """Where the roles on other workers reach this task: its worker's host."""
    worker = ctx.tasks[0][1] if ctx.tasks else None
    return worker.split("://")[-1].rsplit(":", 1)[0] if worker else "127.0.0.1"


class Roles:
    """The trained roles of one stage: started, followed, their errors kept."""

    def __init__(self, cfg: RLConfig, ctx: StageContext, stage_dir: str) -> None:
        self.cfg, self.ctx, self.dir = cfg, ctx, stage_dir
        self.errors: list[BaseException] = []

    def start(self, role: str, spec: Any, end: Any) -> threading.Thread | None:
        """Write the role's spec and start its ranks: here when its devices are on this
        worker (or there are none), else the stage's task on its worker starts them
        (`host_roles`); then wait for its rank 0 to connect."""
        from stages.lib.launch import Ranks

        path = f"{self.dir}/{role}_spec.json"
        spec.write(path)
        workers = {s.worker for s in self.ctx.slots if s.role == role}
        if len(workers) > 1:
            raise ValueError(
                f"role '{role}' spans {len(workers)} workers; an rl role runs on one worker"
            )
        here = not workers or workers == {self.ctx.tasks[0][1]}
        thread = None
        if here:
            device, world, names = self.devices(role)
            thread = self.launch(role, Ranks(world=world, devices=names), device)
        else:
            assert self.ctx.link is not None
            self.ctx.link.publish(f"spec-{role}", path)
        alive = thread.is_alive if thread is not None else self.remote_alive
        end.accept(alive, timeout_s=600)
        return thread

    def remote_alive(self) -> bool:
        return self.ctx.link is None or self.ctx.link.aborted() is None

    def devices(self, role: str) -> tuple[Literal["cpu", "cuda"], int, tuple[str, ...]]:
        """Device kind, ranks of `role` (its devices on whichever worker) and, here, their
        CUDA_VISIBLE_DEVICES names."""
        devices = [d for s in self.ctx.slots if s.role == role for d in s.devices]
        if not devices:
            return "cpu", self.cfg.num_processes, ()
        import torch

        names = self.ctx.device_env(role).get("CUDA_VISIBLE_DEVICES", "")
        device: Literal["cpu", "cuda"] = "cuda" if torch.cuda.is_available() else "cpu"
        return device, len(devices), tuple(names.split(",")) if names else ()

    def launch(self, role: str, ranks: Any, device: str) -> threading.Thread:
        """Start `role`'s ranks (`stages.rl.<role>`) in a thread that follows them."""
        from stages.lib.launch import launch

        def follow() -> None:
            try:
                launch(
                    f"stages.rl.{role}",
                    f"{self.dir}/{role}_spec.json",
                    ranks,
                    device,
                    self.cfg.num_threads,
                    f"{self.dir}/{role}_log.txt",
                    self.ctx.log,
                )
            except BaseException as exc:
                self.errors.append(exc)

        thread = threading.Thread(target=follow, name=f"rl-{role}", daemon=True)
        thread.start()
        return thread
