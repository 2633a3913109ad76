"""Weight sync from the actor to the rollout engine: one interface, several backends.

Input: the actor's parameters (rank 0 sends; under ZeRO-3 every rank takes part in
gathering each parameter, one at a time). Output: the engine's model holding the same
weights. Then `verify` compares the engine's log-probabilities of a fixed probe with the
actor's: a return code is never trusted (NCCL is a silent no-op off the GPU, CPU kernels
may repack weights), a mismatch fails the step naming the engine.

- `gloo`: one process group of actor rank 0 (group rank 0) and every engine (ranks 1..E:
  the controller's own engine, which hosts the TCP store, then the engines other tasks
  host; with vLLM servers every worker of every server, `stages.rl.sync.vllm`), on the
  controller's reachable address; the parameters are broadcast once to all engines at
  once, in buckets of `sync_bucket_mb` (`stages.lib.distributed.weight_group`: the same
  protocol into a local engine and into vLLM's workers); a sync past `timeout_s` raises.
- `nccl`: the same on CUDA tensors (GPU only; on a CPU run the stage uses gloo instead and
  records why).
- `disk`: rank 0 writes safetensors atomically, the engine reloads them parameter by
  parameter.

Weights travel in one dtype both ends know (`wire_dtype`: bfloat16 when the actor trains in
bf16, float32 otherwise): the publisher casts each tensor to it, each receiver allocates its
buffer in it and copies into the engine's parameter (casting to the engine's own dtype). A
broadcast needs equal byte counts on every rank: DeepSpeed holds a bf16 actor's weights in
bf16 while the local engine keeps fp32, so sending "as they are" into `empty_like(param)`
put 2N bytes into a 4N buffer (garbage on gloo: the probe failed at step 0 on CPU and
sampling met NaN probabilities on an H100; undefined under NCCL).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import torch

from stages.lib.distributed import weight_group

if TYPE_CHECKING:
    from typing_extensions import Unpack

# The probe's rules, per token in nats (`probe_rule`, `verify`; docs/rl/on-policy.md "The probe").
# An engine that computes the actor's own function (the local engine: the same model code,
# dtype path and adapter math) scores the same weights bit for bit: Gemma 3 270M with LoRA in
# bf16 measured a difference of exactly 0 on every probe token (bench/probe_numerics.py), so
# anything over float32's print of a log-probability is weights that did not arrive.
SAME_FUNCTION_TOLERANCE = 1e-6
OTHER_KERNELS_FP32_TOLERANCE = 1e-4  # vLLM's kernels in fp32: each token (tests/gpu)
# vLLM's kernels in bf16 compute another function than the actor's: no per-token bound is
# measured yet (a GPU run); the mean over the probe is judged, and an engine whose probe moved
# since the previous sync may keep a mean up to 1 nat (rounding alone cannot move a probe).
OTHER_KERNELS_BF16_MEAN = 0.15
BF16_MOVED_LIMIT = 1.0


def tied_aliases(module: torch.nn.Module) -> dict[str, str]:
    """Tied weights (lm_head = embeddings): each second name -> the name it is sent under
    (vLLM's CPU build keeps its own copy of a tied head, which reloads only by its name)."""
    once = {id(p): n for n, p in module.named_parameters()}
    return {
        n: once[id(p)]
        for n, p in module.named_parameters(remove_duplicate=False)
        if once.get(id(p), n) != n
    }


def wire_dtype(bf16: bool, trainer: str = "deepspeed") -> torch.dtype:
    """The dtype the weights travel in: the one the actor's module holds, so the engine gets
    the very weights the actor computes with (bf16 under DeepSpeed in bf16; fp32 for the torch
    trainer, whose bf16 is autocast over fp32 weights, as its local engine's then is:
    `engine_autocast`; fp32 in fp32)."""
    return torch.bfloat16 if bf16 and trainer == "deepspeed" else torch.float32


def engine_autocast(bf16: bool, trainer: str) -> bool:
    """Whether the local engine computes under bf16 autocast over fp32 weights: the torch
    trainer's bf16, so both sides run the same function."""
    return bf16 and trainer == "torch"


class SyncFailed(RuntimeError):
    """Weights did not arrive, or the engine does not score like the actor after a sync."""


class Publisher(Protocol):
    """The actor's side."""

    aliases: dict[str, str]

    stats: dict[str, float]  # the last publish: gather_s, send_s, bytes

    def publish(
        self, params: Iterator[tuple[str, torch.Tensor]], shapes: list[tuple[str, list[int]]]
    ) -> None: ...


class Receiver(Protocol):
    """The engine's side."""

    name: str
    stats: dict[str, float]  # the last apply: load_s (and recv_s, bytes where it receives)

    def apply(self, model: torch.nn.Module) -> None: ...


NCCL_ENV = weight_group.NCCL_ENV
_pg = weight_group.process_group


class GroupPublisher:
    """gloo or nccl: actor rank 0 is rank 0 of a group with every engine (`world` = 1 +
    engine ranks), sending in buckets of `bucket_mb`."""

    def __init__(
        self,
        store_address: str,
        timeout_s: float,
        nccl: bool = False,
        world: int = 2,
        wire: torch.dtype = torch.float32,
        bucket_mb: int = weight_group.BUCKET_MB,
    ) -> None:
        store = weight_group.client_store(store_address, world, timeout_s)
        self.pg = _pg(store, 0, world, timeout_s, nccl)
        self.device = "cuda" if nccl else "cpu"
        self.wire = wire
        self.bucket_bytes = bucket_mb << 20
        self.aliases: dict[str, str] = {}  # tied weights: vLLM's CPU build reloads each name
        self.stats: dict[str, float] = {}

    def publish(
        self, params: Iterator[tuple[str, torch.Tensor]], shapes: list[tuple[str, list[int]]]
    ) -> None:
        self.stats = weight_group.send(
            self.pg,
            params,
            shapes,
            wire=self.wire,
            device=self.device,
            bucket_bytes=self.bucket_bytes,
            aliases=self.aliases,
        )


class GroupReceiver:
    """An engine's end of the gloo/nccl group. Rank 1 (the controller's engine) hosts the
    rendezvous store on `host`; an engine of another task joins it at `store_address` as
    rank 2, 3, ..."""

    def __init__(
        self,
        name: str,
        timeout_s: float,
        nccl: bool = False,
        host: str = "127.0.0.1",
        device: str = "cpu",
        world: int = 2,
        rank: int = 1,
        store_address: str | None = None,
        wire: torch.dtype = torch.float32,
    ) -> None:

        self.name = name
        self.wire = wire
        self.timeout_s, self.nccl, self.device = timeout_s, nccl, device
        self.world, self.rank = world, rank
        if store_address is None:
            self.store, self.address = weight_group.host_store(host, timeout_s)
        else:
            self.store = weight_group.client_store(store_address, world, timeout_s)
            self.address = store_address
        self.pg: Any = None
        self.stats: dict[str, float] = {}

    def apply(self, model: torch.nn.Module) -> None:
        if self.pg is None:  # the first sync: the actor joins the group then
            if self.nccl:
                torch.cuda.set_device(torch.device(self.device))
            self.pg = _pg(self.store, self.rank, self.world, self.timeout_s, self.nccl)
        where = self.device if self.nccl else "cpu"
        params = dict(model.named_parameters(remove_duplicate=False))  # tied: every name
        stats: dict[str, float] = {}
        start = time.perf_counter()
        with torch.no_grad():
            try:
                for name, tensor in weight_group.receive(self.pg, where, stats):
                    if name not in params:
                        raise SyncFailed(f"engine '{self.name}': no parameter '{name}'")
                    params[name].copy_(tensor)  # cast to the engine's own dtype
            except RuntimeError as exc:
                if isinstance(exc, SyncFailed):
                    raise
                raise SyncFailed(f"engine '{self.name}': weights did not arrive: {exc}") from None
        total = time.perf_counter() - start
        self.stats = {**stats, "load_s": max(0.0, total - stats.get("recv_s", 0.0))}


class DiskPublisher:
    """Rank 0 writes every parameter to one safetensors file, atomically. A tied weight is
    written under each of its names (`aliases`: name -> the name it is stored under): vLLM's
    CPU build keeps its own copy of a tied output head, which reloads only by its name."""

    def __init__(self, path: str, wire: torch.dtype = torch.float32) -> None:
        self.path = path
        self.wire = wire
        self.aliases: dict[str, str] = {}
        self.stats: dict[str, float] = {}

    def publish(
        self, params: Iterator[tuple[str, torch.Tensor]], shapes: list[tuple[str, list[int]]]
    ) -> None:
        from safetensors.torch import save_file

        start = time.perf_counter()
        tensors = {name: t.detach().to("cpu", self.wire).contiguous().clone() for name, t in params}
        for alias, name in self.aliases.items():
            if name in tensors:
                tensors[alias] = tensors[name].clone()
        gathered = time.perf_counter()
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = f"{self.path}.tmp-{os.getpid()}"
        save_file(tensors, tmp)
        os.replace(tmp, self.path)
        self.stats = {
            "gather_s": gathered - start,
            "send_s": time.perf_counter() - gathered,  # the write
            "bytes": float(os.path.getsize(self.path)),
        }


class DiskReceiver:
    """The engine reloads the file parameter by parameter, once the actor has written it
    (every parameter, or with LoRA the adapters: those the file holds)."""

    pulls = True

    def __init__(self, name: str, path: str) -> None:
        self.name, self.path = name, path
        self.stats: dict[str, float] = {}

    def apply(self, model: torch.nn.Module) -> None:
        from safetensors import safe_open

        start = time.perf_counter()
        params = dict(model.named_parameters(remove_duplicate=False))
        with torch.no_grad(), safe_open(self.path, framework="pt") as f:  # type: ignore[no-untyped-call]
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if name not in params:
                    raise SyncFailed(f"engine '{self.name}': no parameter '{name}'")
                params[name].copy_(f.get_tensor(name))
        self.stats = {"load_s": time.perf_counter() - start}


def sync_file(stage_dir: str) -> str:
    """Where the disk sync writes: a folder of its own, which a vLLM server reloads whole."""
    return f"{stage_dir.rstrip('/')}/sync/model.safetensors"


class GroupPlace(TypedDict, total=False):
    """An engine's place in the gloo/nccl group and the dtype its weights arrive in: the
    keywords of `GroupReceiver`, which `make_receiver` passes on (defaults there)."""

    host: str
    world: int
    rank: int
    store_address: str | None
    wire: torch.dtype


def make_receiver(
    kind: str,
    name: str,
    path: str,
    timeout_s: float,
    device: str = "cpu",
    **place: Unpack[GroupPlace],
) -> Receiver:
    """The engine's side of `kind` (gloo, nccl or disk) for an engine on `device`: group
    rank `rank` of `world` (1 + engines); rank 1 hosts the store on `host` (its `address`
    is where the actor's rank 0 and the other engines join), the others join
    `store_address`. Weights arrive in `wire` (`wire_dtype`)."""
    if kind == "disk":
        return DiskReceiver(name, path)
    return GroupReceiver(name, timeout_s, nccl=kind == "nccl", device=device, **place)


def make_publisher(
    kind: str,
    store_address: str,
    path: str,
    timeout_s: float,
    world: int = 2,
    wire: torch.dtype = torch.float32,
    bucket_mb: int = weight_group.BUCKET_MB,
) -> Publisher:
    """The actor's side of `kind`: group rank 0 of `world` (1 + engine ranks), sending in
    `wire`, in buckets of `bucket_mb`."""
    if kind == "disk":
        return DiskPublisher(path, wire)
    return GroupPublisher(
        store_address, timeout_s, nccl=kind == "nccl", world=world, wire=wire, bucket_mb=bucket_mb
    )


@dataclass(frozen=True)
class ProbeRule:
    """How an engine's probe is judged against the actor's: every token within `token` nats
    (an engine of the actor's own function, or other kernels in fp32), or the mean within
    `mean` (other kernels in bf16: see `OTHER_KERNELS_BF16_MEAN`)."""

    token: float | None = SAME_FUNCTION_TOLERANCE
    mean: float | None = None

    @property
    def described(self) -> str:
        if self.token is not None:
            return f"every token within {self.token:g} nats"
        return f"the mean within {self.mean:g} nats (another engine's bf16 kernels)"


SAME_FUNCTION = ProbeRule()


def other_kernels(bf16: bool) -> ProbeRule:
    """An engine of other kernels (vLLM) against the actor."""
    if bf16:
        return ProbeRule(token=None, mean=OTHER_KERNELS_BF16_MEAN)
    return ProbeRule(token=OTHER_KERNELS_FP32_TOLERANCE)


def verify(
    engine: str,
    engine_lp: list[float],
    actor_lp: list[float],
    rule: ProbeRule,
    step: int,
    before: list[float] | None = None,
) -> float:
    """The largest difference between the engine's and the actor's probe log-probabilities;
    `SyncFailed` naming the engine (and the worst token) when the weights did not arrive:
    a token past `rule.token`, or with `rule.mean` a mean past it, unless the engine's probe
    moved since the last sync (`before`, its scores then) and stays within 1 nat."""
    if len(engine_lp) != len(actor_lp):
        raise SyncFailed(
            f"step {step}: engine '{engine}' scored {len(engine_lp)} probe tokens, "
            f"the actor {len(actor_lp)}"
        )
    diffs = [abs(a - b) for a, b in zip(engine_lp, actor_lp, strict=True)]
    worst = max(diffs, default=0.0)
    at = diffs.index(worst) if diffs else 0
    still = before == engine_lp
    why = "the engine's probe did not move since the last sync: " if still else ""
    if rule.token is not None:
        if worst <= rule.token:
            return worst
        what = f"{worst:.3g} at token {at} of {len(diffs)} (tolerance {rule.token:g} a token)"
    else:
        mean = sum(diffs) / len(diffs) if diffs else 0.0
        assert rule.mean is not None
        if mean <= rule.mean:
            return worst
        if before is not None and not still and mean <= BF16_MOVED_LIMIT:
            return worst
        what = f"the mean {mean:.3g} (tolerance {rule.mean:g})"
    raise SyncFailed(
        f"step {step}: engine '{engine}' does not match the actor after the weight sync: "
        f"probe log-probabilities differ by {what}; {why}the weights did not arrive"
    )


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
