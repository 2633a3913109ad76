"""Weights over a process group, in buckets: actor rank 0 sends, every engine receives.

Input (sender): the parameters in order, as (name, tensor), their full shapes known up
front, the wire dtype and a bucket size. Output (receiver): the same (name, tensor) pairs,
as views of each received bucket, the next bucket arriving while the caller loads one.

Protocol, all broadcasts from group rank 0:
1. the header: its byte count (one int64), then its bytes (uint8): JSON with the wire dtype
   and the buckets, each a list of [name, shape, aliases] (aliases: other names the engine
   knows the same tensor by, as tied weights);
2. each bucket as one flat tensor of the wire dtype.

The sender holds at most `bucket_bytes` beyond its own shard: two half-size buffers, one
packed while the other is on the wire; under ZeRO-3 each parameter is gathered for the
moment it is packed (or sent), then released. Both ends need only
torch (this module runs in vLLM's interpreter too, inside its workers: `vllm_ext`).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

NCCL_ENV = {
    # read by ProcessGroupNCCL's constructor, so set before the sync group is built: a wait
    # past the group's timeout raises in the waiting thread (the step fails with SyncFailed,
    # the stage retries) instead of returning at once and leaving the watchdog to act, and
    # the watchdog aborts the communicator without tearing the process down (on the engine's
    # side that process is the Dask worker or vLLM's engine core).
    # torch 2.13's defaults: no blocking wait, error handling 3 (tear down).
    "TORCH_NCCL_BLOCKING_WAIT": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
}
BUCKET_MB = 256  # the default bucket: large enough that a broadcast runs at the link's speed


def process_group(store: Any, rank: int, world: int, timeout_s: float, nccl: bool) -> Any:
    """A gloo (or NCCL) group of `world` ranks rendezvousing through `store`."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if nccl:
        for key, value in NCCL_ENV.items():
            os.environ.setdefault(key, value)  # a user's own setting stays
        options = dist.ProcessGroupNCCL.Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, options)  # type: ignore[attr-defined]
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def host_store(host: str, timeout_s: float) -> tuple[Any, str]:
    """A TCP store hosted here on `host` (a free port) and its "host:port"; it does not wait
    for the ranks that will join it."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, 0, None, True, timeout=timeout, wait_for_workers=False)  # type: ignore[attr-defined]
    return store, f"{host}:{store.port}"


def client_store(address: str, world: int | None, timeout_s: float) -> Any:
    """A client of the TCP store at `address` ("host:port")."""
    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, int(port), world, False, timeout=timeout)  # type: ignore[attr-defined]


ALONE_BYTES = 4 << 20  # a tensor this large travels alone: packing it would only copy it


def buckets(
    shapes: Sequence[tuple[str, Sequence[int]]], itemsize: int, bucket_bytes: int
) -> list[list[tuple[str, list[int]]]]:
    """`shapes` in order, cut into buckets of at most `bucket_bytes`; a tensor of
    `ALONE_BYTES` or more (or over the bucket) travels in a bucket of its own."""
    out: list[list[tuple[str, list[int]]]] = []
    size = 0
    alone = min(ALONE_BYTES, bucket_bytes)
    for name, shape in shapes:
        nbytes = math.prod(shape) * itemsize
        if not out or nbytes >= alone or size + nbytes > bucket_bytes or size >= alone:
            out.append([])
            size = 0
        out[-1].append((name, list(shape)))
        size += nbytes
    return out


def _broadcast_header(pg: Any, header: dict[str, Any] | None, device: str) -> dict[str, Any]:
    if header is not None:
        raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        length = torch.tensor([raw.numel()], dtype=torch.int64, device=device)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=device)
    pg.broadcast(length, 0).wait()
    data = (
        raw.to(device)
        if header is not None
        else torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    )
    pg.broadcast(data, 0).wait()
    return header if header is not None else json.loads(data.cpu().numpy().tobytes().decode())


def send(
    pg: Any,
    params: Iterable[tuple[str, torch.Tensor]],
    shapes: Sequence[tuple[str, Sequence[int]]],
    *,
    wire: torch.dtype,
    device: str,
    bucket_bytes: int,
    aliases: dict[str, str] | None = None,
) -> dict[str, float]:
    """Broadcast `params` (in the order of `shapes`, their full shapes) bucket by bucket;
    `aliases` (alias -> the name sent) travel in the header. Returns the seconds spent
    gathering and packing (`gather_s`), waiting on broadcasts (`send_s`), and the `bytes`.

    Pipelined within `bucket_bytes`: two half-size buffers, one packed while the other is on
    the wire. A parameter that fills a bucket alone and is already in the wire dtype on the
    wire's device travels as it is (no copy), its broadcast finished before the next
    parameter is asked for (under ZeRO-3 the gathered tensor is released then)."""
    also: dict[str, list[str]] = {}
    for alias, name in (aliases or {}).items():
        also.setdefault(name, []).append(alias)
    itemsize = torch.empty(0, dtype=wire).element_size()
    half = max(bucket_bytes // 2, itemsize)
    plan = buckets(shapes, itemsize, half)
    header = {
        "wire": str(wire).removeprefix("torch."),
        "buckets": [[[n, s, also.get(n, [])] for n, s in b] for b in plan],
    }
    stats = {"gather_s": 0.0, "send_s": 0.0, "bytes": 0.0}
    t = time.perf_counter()
    _broadcast_header(pg, header, device)
    stats["send_s"] += time.perf_counter() - t
    it = iter(params)
    buffers: list[torch.Tensor | None] = [None, None]
    works: list[Any] = [None, None]

    def wait(slot: int) -> None:
        if works[slot] is not None:
            t = time.perf_counter()
            works[slot].wait()
            stats["send_s"] += time.perf_counter() - t
            works[slot] = None

    for k, bucket in enumerate(plan):
        slot = k % 2
        wait(slot)  # its buffer is free again
        t = time.perf_counter()
        numel = sum(math.prod(s) for _, s in bucket)
        first = _next(it, bucket[0][0])
        as_is = (
            len(bucket) == 1
            and first.dtype == wire
            and first.device.type == torch.device(device).type
            and first.is_contiguous()
        )
        if as_is:
            flat = first.detach().reshape(-1)
        else:
            buf = buffers[slot]
            if buf is None or buf.numel() < numel:
                buf = buffers[slot] = torch.empty(
                    max(numel, half // itemsize), dtype=wire, device=device
                )
            flat = buf[:numel]
            at = 0
            for i, (name, shape) in enumerate(bucket):
                tensor = first if i == 0 else _next(it, name)
                n = math.prod(shape)
                flat[at : at + n].copy_(tensor.detach().reshape(-1))
                at += n
        stats["gather_s"] += time.perf_counter() - t
        works[slot] = pg.broadcast(flat, 0)
        stats["bytes"] += numel * itemsize
        if as_is:
            wait(slot)
    wait(0)
    wait(1)
    return stats


def _next(it: Iterator[tuple[str, torch.Tensor]], name: str) -> torch.Tensor:
    got, tensor = next(it)
    if got != name:
        raise RuntimeError(f"weight sync: parameter '{got}' where '{name}' was announced")
    return tensor


def receive(pg: Any, device: str, stats: dict[str, float]) -> Iterator[tuple[str, torch.Tensor]]:
    """The sender's parameters, as views of each received bucket (under each alias too);
    `stats` gains the seconds spent waiting on broadcasts (`recv_s`) and the `bytes`
    received. The next bucket is already arriving while the caller loads this one."""
    stats.setdefault("recv_s", 0.0)
    stats.setdefault("bytes", 0.0)
    t = time.perf_counter()
    header = _broadcast_header(pg, None, device)
    stats["recv_s"] += time.perf_counter() - t
    wire = getattr(torch, header["wire"])
    plan = header["buckets"]

    def start(k: int) -> tuple[torch.Tensor, Any]:
        numel = sum(math.prod(s) for _, s, _ in plan[k])
        flat = torch.empty(numel, dtype=wire, device=device)
        return flat, pg.broadcast(flat, 0)

    coming = start(0) if plan else None
    for k, bucket in enumerate(plan):
        assert coming is not None
        flat, work = coming
        t = time.perf_counter()
        work.wait()
        stats["recv_s"] += time.perf_counter() - t
        stats["bytes"] += flat.numel() * flat.element_size()
        coming = start(k + 1) if k + 1 < len(plan) else None
        at = 0
        for name, shape, aliases in bucket:
            n = math.prod(shape)
            view = flat[at : at + n].view(shape)
            at += n
            yield name, view
            for alias in aliases:
                yield alias, view
