"""Weights over a process group, in buckets: actor rank 0 sends, every engine receives.

Input (sender): the parameters in order, as (name, tensor), their full shapes known up
front, the wire dtype and a bucket size. Output (receiver): the same (name, tensor) pairs,
as views of the received bucket, one bucket alive at a time.

Protocol, all broadcasts from group rank 0:
1. the header: its byte count (one int64), then its bytes (uint8): JSON with the wire dtype
   and the buckets, each a list of [name, shape, aliases] (aliases: other names the engine
   knows the same tensor by, as tied weights);
2. each bucket as one flat tensor of the wire dtype.

The sender holds one bucket beyond the parameter being packed: under ZeRO-3 each parameter
is gathered for the moment it is copied into the bucket, then released. Both ends need only
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


def client_store(address: str, world: int | None, timeout_s: float) -> Any:
    """A client of the TCP store at `address` ("host:port")."""
    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, int(port), world, False, timeout=timeout)  # type: ignore[attr-defined]


def buckets(
    shapes: Sequence[tuple[str, Sequence[int]]], itemsize: int, bucket_bytes: int
) -> list[list[tuple[str, list[int]]]]:
    """`shapes` in order, cut into buckets of at most `bucket_bytes` (a larger parameter
    travels alone)."""
    out: list[list[tuple[str, list[int]]]] = []
    size = 0
    for name, shape in shapes:
        nbytes = math.prod(shape) * itemsize
        if not out or (size + nbytes > bucket_bytes and out[-1]):
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
    gathering and packing (`gather_s`), in broadcasts (`send_s`), and the `bytes` sent."""
    also: dict[str, list[str]] = {}
    for alias, name in (aliases or {}).items():
        also.setdefault(name, []).append(alias)
    plan = buckets(shapes, torch.empty(0, dtype=wire).element_size(), bucket_bytes)
    header = {
        "wire": str(wire).removeprefix("torch."),
        "buckets": [[[n, s, also.get(n, [])] for n, s in b] for b in plan],
    }
    gather = send_s = 0.0
    sent = 0
    t = time.perf_counter()
    _broadcast_header(pg, header, device)
    send_s += time.perf_counter() - t
    it = iter(params)
    for bucket in plan:
        t = time.perf_counter()
        flat = torch.empty(sum(math.prod(s) for _, s in bucket), dtype=wire, device=device)
        at = 0
        for name, shape in bucket:
            got, tensor = next(it)
            if got != name:
                raise RuntimeError(f"weight sync: parameter '{got}' where '{name}' was announced")
            n = math.prod(shape)
            flat[at : at + n].copy_(tensor.detach().reshape(-1))
            at += n
        gather += time.perf_counter() - t
        t = time.perf_counter()
        pg.broadcast(flat, 0).wait()
        send_s += time.perf_counter() - t
        sent += flat.numel() * flat.element_size()
    return {"gather_s": gather, "send_s": send_s, "bytes": float(sent)}


def receive(pg: Any, device: str, stats: dict[str, float]) -> Iterator[tuple[str, torch.Tensor]]:
    """The sender's parameters, as views of each received bucket (under each alias too);
    `stats` gains the seconds spent in broadcasts (`recv_s`) and the `bytes` received."""
    stats.setdefault("recv_s", 0.0)
    stats.setdefault("bytes", 0.0)
    t = time.perf_counter()
    header = _broadcast_header(pg, None, device)
    stats["recv_s"] += time.perf_counter() - t
    wire = getattr(torch, header["wire"])
    for bucket in header["buckets"]:
        flat = torch.empty(sum(math.prod(s) for _, s, _ in bucket), dtype=wire, device=device)
        t = time.perf_counter()
        pg.broadcast(flat, 0).wait()
        stats["recv_s"] += time.perf_counter() - t
        stats["bytes"] += flat.numel() * flat.element_size()
        at = 0
        for name, shape, aliases in bucket:
            n = math.prod(shape)
            view = flat[at : at + n].view(shape)
            at += n
            yield name, view
            for alias in aliases:
                yield alias, view
