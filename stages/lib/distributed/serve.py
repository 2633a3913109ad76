"""How a role's ranks take requests: rank 0 from the stage's channel, the others from the
process group's store, never inside a collective.

Input: the rank's connection to the stage (rank 0; None elsewhere) and the world size.
Output: each request in order, on every rank. Rank 0 receives a request and puts it in the
default store (the rendezvous TCP store) under `pipe-req-<n>`; every other rank waits for
that key in slices of `POLL_S`, for as long as it takes (the controller may generate,
evaluate or save for an hour between two requests: a collective would fail its ranks after
its timeout, DeepSpeed's 10 minutes by default), reads it and counts itself read; rank 0
deletes a request's keys once every rank has read it, and before it stops (the store lives
in its process) waits until every rank has read `stop`. A rank whose parent dies ends (the
rank's `die_with_parent`); a store that cannot be reached raises.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
from typing import Any

# one wait on the store lasts this long, then the next begins (torch logs each one that
# times out: once an hour); a rank 0 that dies breaks the wait at once (the store is its)
POLL_S = float(os.environ.get("PIPE_REQUEST_POLL_S", 3600))


class Requests:
    """The requests of one rank, `next()` after `next()`."""

    def __init__(self, world: int, conn: Any) -> None:
        self.world, self.conn, self.n = world, conn, 0
        self.store: Any = None
        self.unread: list[int] = []
        if world > 1:
            import torch.distributed as dist

            self.store = dist.distributed_c10d._get_default_store()

    def next(self) -> Any:
        self.n += 1
        key = f"pipe-req-{self.n}"
        if self.conn is not None:
            message = self.conn.recv()
            if self.store is not None:
                self.store.set(key, pickle.dumps(message))
                self._forget_read()
                self.unread.append(self.n)
            return message
        self._wait(key)
        message = pickle.loads(self.store.get(key))
        self.store.add(f"pipe-read-{self.n}", 1)
        return message

    def read_by_all(self, timeout_s: float = 60.0) -> bool:
        """Rank 0, before it exits (the store lives in its process): whether every other rank
        has read the last request, waiting up to `timeout_s` for them."""
        if self.store is None or self.conn is None:
            return True
        deadline = time.monotonic() + timeout_s
        while self.store.add(f"pipe-read-{self.n}", 0) < self.world - 1:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _wait(self, key: str) -> None:
        import torch.distributed as dist

        while True:
            try:
                self.store.wait([key], datetime.timedelta(seconds=POLL_S))
                return
            except dist.DistStoreError as exc:  # a timeout: wait on; anything else raises
                if "timeout" not in str(exc).lower():
                    raise

    def _forget_read(self) -> None:
        """Delete the keys of requests every other rank has read."""
        left = []
        for n in self.unread:
            if self.store.add(f"pipe-read-{n}", 0) >= self.world - 1:
                self.store.delete_key(f"pipe-req-{n}")
                self.store.delete_key(f"pipe-read-{n}")
            else:
                left.append(n)
        self.unread = left
