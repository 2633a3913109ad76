"""The rl stage's weight sync inside vLLM's workers: a worker extension.

vLLM starts with `--worker-extension-cls stages.lib.backends.vllm.worker_ext.WeightSync` mixes this
class into every worker of the server (each tensor-parallel worker, in the engine core's process on
a CPU build) and lets `POST /collective_rpc {"method": NAME, "kwargs": {...}}` call its methods on
all of them, each worker's return value in the reply's `results`. Only torch is needed here
(`stages.lib.distributed.weight_group`): the actor's interpreter never imports vLLM, and this module
never imports anything of ours beyond torch-only code.

- `pipe_sync_info()`: the worker's rank in its engine and its device (how many group ranks
  the engine needs).
- `pipe_sync_join(store, base, world, timeout_s, nccl)`: join the weight-sync group at the
  TCP store `store` as rank `base` + the worker's rank; blocks until every member (actor
  rank 0 and every engine worker) has joined, or fails after `timeout_s`.
- `pipe_sync_receive()`: receive the actor's buckets and load them in place through vLLM's
  own `reload_weights` (checkpoint names; it runs each model's `load_weights`, shards for
  tensor parallelism, and repacks what the device's kernels need), the next bucket arriving
  while one loads; returns the seconds spent receiving and loading and the bytes received.

The caller drops the prefix cache afterwards (`/reset_prefix_cache`): cached KV blocks were
computed with the old weights.
"""

from __future__ import annotations

import time
from typing import Any

EXTENSION = "stages.lib.backends.vllm.worker_ext.WeightSync"  # what `--worker-extension-cls` names


class WeightSync:
    """Mixed into vLLM's worker class: every name here is new to it (vLLM checks)."""

    _pipe_group: Any = None

    def pipe_sync_info(self) -> dict[str, Any]:
        return {"rank": int(self.rank), "device": str(self.device)}  # type: ignore[attr-defined]

    def pipe_sync_join(
        self, store: str, base: int, world: int, timeout_s: float, nccl: bool
    ) -> dict[str, Any]:
        from stages.lib.distributed.weight_group import client_store, process_group

        rank = int(base) + int(self.rank)  # type: ignore[attr-defined]
        client = client_store(store, None, float(timeout_s))
        self._pipe_group = process_group(client, rank, int(world), float(timeout_s), bool(nccl))
        return {"rank": rank, "world": int(world)}

    def pipe_sync_receive(self) -> dict[str, Any]:
        from stages.lib.distributed.weight_group import receive

        if self._pipe_group is None:
            raise RuntimeError("pipe_sync_receive before pipe_sync_join")
        stats: dict[str, float] = {}
        device = str(self.device)  # type: ignore[attr-defined]
        start = time.perf_counter()
        weights = receive(self._pipe_group, device, stats)
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)  # type: ignore[attr-defined]
        total = time.perf_counter() - start
        return {**stats, "load_s": max(0.0, total - stats.get("recv_s", 0.0))}
