"""Weight sync into vLLM servers: a collective into their workers, or the disk.

Input: the controller's `VLLMEngine` (every server's URL and name). Output: every server
holding the actor's weights, and what the sync cost (`stats`).

- `VLLMGroupReceiver` (`gloo`, `nccl`): the controller hosts the rendezvous store on its
  reachable address; actor rank 0 is group rank 0, and every worker of every engine (each
  tensor-parallel worker, on every node of the role) a rank after it, reached through vLLM's
  `/collective_rpc` and our worker extension (`stages.lib.backends.vllm.worker_ext`). The first sync
  joins them (an engine that cannot reach the store or the actor fails it, naming both ends: that
  sync is the stage's start); each sync then broadcasts the weights once, in buckets, to all engines
  at the same time (`stages.lib.distributed.weight_group`), each worker loading them in place, and
  the prefix caches are dropped. No file is written.
- `VLLMLoraReceiver` (LoRA): the actor's adapters alone, as peft files each server loads
  as a new LoRA adapter; the base weights never move.
- `VLLMDiskReceiver` (`disk`, the explicit choice): actor rank 0 writes
  `<stage>/sync/model.safetensors`, then every server reloads it (`reload_weights`).

Requests in flight: none. A sync runs between generations in both the synchronous and the
asynchronous loop (the engine samples ahead while the actor trains, then the sync), so
generation is drained before every update; staleness is recorded as before.

One name, two sides of one concept (the rl stage's vLLM engines: the rollouts they generate;
this file: the weights synced into them; `stages/rl/rollout/vllm.py` the other side).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

from stages.rl.sync.transports import SyncFailed


class VLLMEngine(Protocol):
    """What the sync needs of the vLLM engines (`stages.rl.rollout.vllm.VLLMEngine`): each
    server's name and URL, a POST, a health check, and a reload from a folder."""

    name: str
    names: list[str]
    urls: list[str]

    def post(self, url: str, body: dict[str, Any] | None = None, timeout: float = 600) -> Any:
        """POST `body` as JSON to `url`; the reply's JSON."""

    def healthy(self, url: str) -> bool:
        """Whether the server at `url` answers `/health`."""

    def reload(self, weights_dir: str) -> None:
        """Every server loads the weights saved in `weights_dir`."""

    def serve(self, name: str) -> None:
        """Requests name the model (or LoRA adapter) `name` from now on."""


WATCH_S = 2.0  # how often a server is checked while its workers receive


def each_server(engine: VLLMEngine, call: Callable[[str, str], Any]) -> list[Any]:
    """`call(name, url)` for every server at the same time; the first failure raised after
    all have answered, as `SyncFailed` naming its engine."""
    pairs = list(zip(engine.names, engine.urls, strict=True))
    with ThreadPoolExecutor(max_workers=len(pairs)) as pool:
        futures = [pool.submit(call, name, url) for name, url in pairs]
        results, errors = [], []
        for (name, url), future in zip(pairs, futures, strict=True):
            try:
                results.append(future.result())
            except Exception as exc:
                errors.append(f"engine '{name}' ({url}): {exc}")
    if errors:
        raise SyncFailed("; ".join(errors))
    return results


class VLLMGroupReceiver:
    """The controller's side of the collective into vLLM's workers."""

    pulls = False  # the servers receive while the actor sends

    def __init__(self, engine: VLLMEngine, host: str, timeout_s: float, nccl: bool) -> None:
        from stages.lib.distributed.weight_group import host_store

        self.engine, self.timeout_s, self.nccl = engine, timeout_s, nccl
        self.name = engine.name
        self.store, self.address = host_store(host, timeout_s)
        workers = each_server(engine, lambda _, url: self._rpc(url, "pipe_sync_info"))
        self.bases, base = [], 1
        for per_engine in workers:  # one result per worker of that engine
            self.bases.append(base)
            base += len(per_engine)
        self.world = base
        self.group = {"store": self.address, "world": self.world}  # for actor rank 0
        self.joined = False
        self.stats: dict[str, float] = {}

    def _rpc(self, url: str, method: str, **kwargs: Any) -> list[Any]:
        # a little past the group's own timeout: a worker's error (its wait timing out in
        # the group, naming why) arrives before the call gives up
        body = {"method": method, "kwargs": kwargs, "timeout": self.timeout_s + 5}
        reply = self.engine.post(f"{url}/collective_rpc", body, self.timeout_s + 10)
        return list((reply or {}).get("results") or [])

    def _watched(self, url: str, method: str) -> list[Any]:
        """`_rpc` while the server's health is checked every `WATCH_S`: a server whose
        engine core died mid-sync (vLLM's API server may keep the call open until its
        timeout) fails the sync within seconds."""
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            call = pool.submit(self._rpc, url, method)
            while True:
                try:
                    return call.result(timeout=WATCH_S)
                except FutureTimeout:
                    if not self.engine.healthy(url):
                        raise SyncFailed(
                            f"the server stopped answering /health during the sync ({method}): "
                            "its engine core is gone"
                        ) from None
        finally:
            pool.shutdown(wait=False)  # a call left open ends when the server is stopped

    def apply(self, model: Any) -> None:
        """Join (the first time), receive the actor's broadcast in every server, drop their
        prefix caches; `stats` gets the slowest server's receive and load seconds."""
        if not self.joined:
            base = dict(zip(self.engine.urls, self.bases, strict=True))

            def join(name: str, url: str) -> Any:
                try:
                    return self._rpc(
                        url,
                        "pipe_sync_join",
                        store=self.address,
                        base=base[url],
                        world=self.world,
                        timeout_s=self.timeout_s,
                        nccl=self.nccl,
                    )
                except Exception as exc:
                    raise SyncFailed(
                        f"could not join the weight-sync group of actor rank 0 (rendezvous at "
                        f"{self.address}, {self.world} ranks, {self.timeout_s:g} s): {exc}"
                    ) from None

            each_server(self.engine, join)
            self.joined = True
        start = time.perf_counter()
        results = each_server(self.engine, lambda _, url: self._watched(url, "pipe_sync_receive"))
        loaded = time.perf_counter() - start
        each_server(
            self.engine,
            lambda _, url: self.engine.post(f"{url}/reset_prefix_cache", None, self.timeout_s),
        )
        workers = [w for per_engine in results for w in per_engine if isinstance(w, dict)]
        self.stats = {
            "load_s": max((w.get("load_s", 0.0) for w in workers), default=loaded),
            "recv_s": max((w.get("recv_s", 0.0) for w in workers), default=0.0),
        }


class VLLMLoraReceiver:
    """LoRA on vLLM servers (`stages.rl.sync.choice.LORA_SYNC`): before each sync the actor is
    told a new folder (`group`), where rank 0 writes its adapters in peft's format; every
    server then loads it as a new adapter named after its version, through vLLM's runtime
    LoRA route (servers started with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING`:
    `stages.rl.rollout.vllm_servers`), the previous one is unloaded, and the engine's requests
    name the new one. A fresh name per version: vLLM caches an adapter by name."""

    pulls = True  # the servers read the folder once the actor has written it

    def __init__(self, engine: VLLMEngine, root: str) -> None:
        self.engine, self.root = engine, root.rstrip("/")
        self.name = engine.name
        self.version = 0
        self.loaded: str | None = None
        self.stats: dict[str, float] = {}

    @property
    def group(self) -> dict[str, str]:
        """What the actor's `sync` request carries: the folder to write this sync's adapters."""
        return {"adapter_dir": self.folder(self.version + 1)}

    def folder(self, version: int) -> str:
        return f"{self.root}/lora-{version:06d}"

    def apply(self, model: Any) -> None:
        start = time.perf_counter()
        version = self.version + 1
        name, path = f"pipe-lora-{version}", self.folder(version)
        load = {"lora_name": name, "lora_path": path}
        route = "v1/load_lora_adapter"
        each_server(self.engine, lambda _, url: self.engine.post(f"{url}/{route}", load))
        old, self.loaded, self.version = self.loaded, name, version
        self.engine.serve(name)
        if old is not None:
            gone = {"lora_name": old}
            each_server(
                self.engine, lambda _, url: self.engine.post(f"{url}/v1/unload_lora_adapter", gone)
            )
            import shutil

            shutil.rmtree(self.folder(version - 1), ignore_errors=True)
        self.stats = {"load_s": time.perf_counter() - start}


class VLLMDiskReceiver:
    """The disk sync into vLLM servers: the actor writes the file, the servers reload it."""

    pulls = True

    def __init__(self, engine: VLLMEngine, path: str) -> None:
        self.engine, self.path = engine, path
        self.name = engine.name
        self.stats: dict[str, float] = {}

    def apply(self, model: Any) -> None:
        start = time.perf_counter()
        self.engine.reload(os.path.dirname(self.path))
        self.stats = {"load_s": time.perf_counter() - start}
