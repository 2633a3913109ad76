"""Every rollout engine of an rl stage, on every worker of the `vllm` role, as one engine.

Input: the controller's own engine (`LocalEngine`, on its worker) and, for each other
worker the placement gives the `vllm` role, an engine that worker's task hosts
(`host_engine`: a `LocalEngine` on that worker's devices, reached over an authenticated
socket, `stages.rl.roles.channel`). Output: what one engine gives the controller: a step's
groups spread over all engines (each prompt's group to one engine, the engines working
at once, answers back in prompt order), the probe scored by every engine, the weights
loaded into every engine at once (`load`), and a record of where each engine ran.

Weights: with gloo or nccl every engine is a rank of the one sync group (the
controller's engine rank 1 and host of its store, the others 2, 3, ... joining it), so
the actor's broadcast reaches all engines at once; with disk each engine reads the file.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from stages.lib.chat.prompt import Prompt
from stages.lib.model.generate import Generation
from stages.rl.algo.logprobs import Sample

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.rl import RLConfig
    from stages.rl.roles.channel import StageEnd
    from stages.rl.rollout.local import LocalEngine

log = logging.getLogger("pipe.rl")
BRIEF_TIMEOUT_S = 900.0
SEED_STRIDE = 1_000_033  # engine i samples with seed + i * stride: no two engines share a stream


class RemoteEngine:
    """An engine another task of the stage hosts, reached through its channel."""

    def __init__(self, name: str, end: StageEnd, where: dict[str, Any], alive: Any) -> None:
        self.name, self.end, self.where, self.alive = name, end, where, alive

    def generate(self, prompts: Sequence[Prompt], **kwargs: Any) -> list[list[Generation]]:
        return self.end.request(  # type: ignore[no-any-return]
            "generate", {"prompts": list(prompts), **kwargs}, timeout_s=3600, alive=self.alive
        )

    def scores(self, sample: Sample) -> dict[str, list[float]]:
        return self.end.request("scores", asdict(sample), timeout_s=600, alive=self.alive)  # type: ignore[no-any-return]


class EnginePool:
    """The controller's engine and the engines of the `vllm` role's other workers."""

    def __init__(self, local: LocalEngine, where: dict[str, Any], remotes: list[RemoteEngine]):
        self.local, self.remotes = local, remotes
        self.probe_rule = local.probe_rule  # every member is a local engine
        self.tokenizer = local.tokenizer
        self.model = local.model
        self.where = [{"name": local.name, **where}] + [
            {"name": r.name, **r.where} for r in remotes
        ]
        self.names = [w["name"] for w in self.where]
        self.name = ",".join(self.names)

    @property
    def pad_id(self) -> int:
        return self.local.pad_id

    @property
    def stop_ids(self) -> list[int]:
        return self.local.stop_ids

    @property
    def stats(self) -> dict[str, Any]:
        """This worker's engine's latest step (the others' stay on their workers)."""
        return dict(getattr(self.local, "stats", None) or {})

    def generate(
        self, prompts: Sequence[Prompt], *, seed: int, **kwargs: Any
    ) -> list[list[Generation]]:
        """Each prompt's group from one engine: the prompts cut into one contiguous part per
        engine, the parts generated at once, the answers in prompt order."""
        if not self.remotes:
            return self.local.generate(prompts, seed=seed, **kwargs)
        members: list[Any] = [self.local, *self.remotes]
        n = len(members)
        bounds = [len(prompts) * i // n for i in range(n + 1)]
        parts = [(i, prompts[bounds[i] : bounds[i + 1]]) for i in range(n)]
        parts = [(i, p) for i, p in parts if p]

        def one(part: tuple[int, Sequence[Prompt]]) -> list[list[Generation]]:
            i, chunk = part
            return members[i].generate(chunk, seed=seed + i * SEED_STRIDE, **kwargs)  # type: ignore[no-any-return]

        with ThreadPoolExecutor(max_workers=len(parts)) as pool:
            return [g for out in pool.map(one, parts) for g in out]

    def scores(self, sample: Sample) -> dict[str, list[float]]:
        """The probe's log-probabilities from every engine."""
        out = self.local.scores(sample)
        for r in self.remotes:
            out |= r.scores(sample)
        return out

    def load(self, receiver: Any) -> None:
        """The weights into every engine at once: the others start receiving, this one
        receives, then each other's answer is awaited (its error names the engine)."""
        for r in self.remotes:
            r.end.send("load")
        receiver.apply(self.local.model)
        for r in self.remotes:
            r.end.receive("load", timeout_s=receiver_timeout(receiver), alive=r.alive)

    def close(self) -> None:
        for r in self.remotes:
            try:
                r.end.request("stop", timeout_s=60)
            except Exception as exc:  # the stage ends anyway; say why an engine did not
                log.warning("engine %s did not stop cleanly: %s", r.name, exc)
            r.end.close()


def receiver_timeout(receiver: Any) -> float:
    return float(getattr(receiver, "timeout_s", 600.0))


def start_pool(
    ctx: StageContext, local: LocalEngine, join: dict[str, Any], alive: Any
) -> EnginePool:
    """The pool of `local` and one engine per other worker of the `vllm` role: each gets
    its brief through the link (`join`: the model, the sync backend and where its group
    meets; and its own group rank) and connects back."""
    from stages.rl.roles.channel import StageEnd
    from stages.rl.roles.launch import host_of
    from stages.rl.roles.layout import role_table

    table = role_table(ctx, "vllm")
    workers = list(dict.fromkeys((r["node"], r["worker"]) for r in table))
    here = ctx.tasks[0] if ctx.tasks else (None, None)
    devices = [r["device"] for r in table if (r["node"], r["worker"]) == here]
    where = {"node": here[0], "worker": here[1], "devices": devices}
    others = [w for w in workers if w != here]
    ends = []
    for i, (node, worker) in enumerate(others, start=1):
        assert ctx.link is not None
        end = StageEnd(host_of(ctx))
        end.who = f"engine 'local-{i}'"
        brief = {
            **join,
            "name": f"local-{i}",
            "rank": 1 + i,
            "channel": end.address,
            "authkey": end.authkey.hex(),
        }
        ctx.link.publish(f"engine-{node}-{worker}", json.dumps(brief))
        ends.append((i, end))
    remotes = []
    for i, end in ends:
        end.accept(alive, timeout_s=BRIEF_TIMEOUT_S)
        placed = end.request("where", timeout_s=600, alive=alive)
        remotes.append(RemoteEngine(f"local-{i}", end, placed, alive))
    return EnginePool(local, where, remotes)


def host_engine(cfg: RLConfig, ctx: StageContext) -> dict[str, Any]:
    """A task of another worker of the `vllm` role: build its engine on this worker's
    devices, connect to the controller and answer its requests until `stop`."""
    import torch

    from stages.lib.devices import torch_device
    from stages.lib.distributed.trainer_choice import choose_trainer
    from stages.rl.roles.channel import connect
    from stages.rl.rollout.local import LocalEngine
    from stages.rl.sync.transports import engine_autocast, make_receiver, wire_dtype

    assert ctx.link is not None
    torch.set_num_threads(cfg.threads)
    node, worker = ctx.tasks[ctx.node_rank]
    brief = json.loads(ctx.link.lookup(f"engine-{node}-{worker}", timeout_s=BRIEF_TIMEOUT_S))
    device = torch_device(ctx, "vllm")
    trainer = choose_trainer(cfg)
    autocast = engine_autocast(cfg.bf16, trainer)
    engine = LocalEngine(brief["model_dir"], device, cfg.bf16, cfg.lora, autocast)
    engine.name = brief["name"]
    receiver = make_receiver(
        brief["kind"],
        brief["name"],
        brief["path"],
        brief["timeout_s"],
        device,
        world=brief["world"],
        rank=brief["rank"],
        store_address=brief["store"] or None,
        wire=wire_dtype(cfg.bf16, trainer),
    )
    conn = connect(brief["channel"], brief["authkey"])
    where = {"node": node, "worker": worker, "devices": list(ctx.devices("vllm"))}
    handlers: dict[str, Any] = {
        "where": lambda _: where,
        "generate": lambda p: engine.generate(p.pop("prompts"), **p),
        "scores": lambda s: engine.scores(Sample(**s)),
        "load": lambda _: receiver.apply(engine.model),
    }
    served = _serve(conn, handlers, ctx)
    log.info("engine %s on %s served %d request(s)", brief["name"], worker, served)
    return {"engine": brief["name"], "requests": served}


def _serve(conn: Any, handlers: dict[str, Any], ctx: StageContext) -> int:
    """Answer the controller's requests in order until `stop` (or the stage aborts)."""
    served = 0
    while True:
        while not conn.poll(1.0):
            if ctx.link is not None and ctx.link.aborted() is not None:
                return served
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            return served  # the controller is gone: the stage's own error says why
        if kind == "stop":
            conn.send(("ok", None))
            return served
        try:
            reply = handlers[kind](payload)
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            raise
        conn.send(("ok", reply))
        served += 1


def spawn(target: Any, name: str, errors: list[BaseException]) -> threading.Thread:
    """`target()` in a daemon thread; what it raises lands in `errors`."""

    def body() -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return thread
