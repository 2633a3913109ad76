"""The stage <-> role channel: one authenticated socket, messages as Python objects.

Input: the stage's `Listener` (host, port, key) and rank 0 of a role (or an engine hosted
by another task) connecting to it. Output: `request(kind, payload)` on the stage side
returns the peer's reply or raises `ActorGone`/`TimeoutError`; the peer receives
requests in order and answers each.
"""

from __future__ import annotations

import secrets
from multiprocessing.connection import Client, Connection, Listener
from typing import Any


class ActorGone(RuntimeError):
    """The actor closed the channel or answered with an error."""


class Peer:
    """One end of an established connection: requests out, replies back, in order."""

    def __init__(self, conn: Connection | None = None, who: str = "the actor") -> None:
        self.conn = conn
        self.who = who

    def send(self, kind: str, payload: Any = None) -> None:
        """Send a request without waiting for its reply."""
        assert self.conn is not None
        try:
            self.conn.send((kind, payload))
        except (BrokenPipeError, OSError) as exc:
            raise ActorGone(f"{self.who} is gone ({exc})") from None

    def receive(self, kind: str, timeout_s: float = 600.0, alive: Any = None) -> Any:
        """The reply to the request sent last (polling `alive()` while waiting)."""
        assert self.conn is not None
        waited = 0.0
        while not self.conn.poll(1.0):
            waited += 1.0
            if alive is not None and not alive():
                raise ActorGone(f"{self.who} exited during '{kind}'")
            if waited > timeout_s:
                raise TimeoutError(f"{self.who} did not answer '{kind}' in {timeout_s:.0f} s")
        try:
            status, reply = self.conn.recv()
        except (EOFError, OSError):
            raise ActorGone(f"{self.who} closed the channel during '{kind}'") from None
        if status != "ok":
            raise ActorGone(f"{self.who} failed '{kind}': {reply}")
        return reply

    def request(
        self, kind: str, payload: Any = None, timeout_s: float = 600.0, alive: Any = None
    ) -> Any:
        """Send a request and return the reply."""
        self.send(kind, payload)
        return self.receive(kind, timeout_s, alive)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


class StageEnd(Peer):
    """The stage's side: listens, accepts the actor's rank 0, sends requests and waits."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        super().__init__()
        self.authkey = secrets.token_bytes(16)
        self.listener = Listener((host, 0), authkey=self.authkey)

    @property
    def address(self) -> str:
        host, port = self.listener.address
        return f"{host}:{port}"

    def accept(self, alive: Any, timeout_s: float) -> None:
        """Wait for the actor to connect; `alive()` False (its processes died) ends the wait."""
        self.conn = accept(self.listener, alive, timeout_s, self.who)

    def close(self) -> None:
        super().close()
        self.listener.close()


def accept(listener: Listener, alive: Any, timeout_s: float, who: str) -> Connection:
    """The first connection to `listener`; `alive()` False or `timeout_s` ends the wait."""
    import threading
    import time

    got: list[Connection] = []
    waiter = threading.Thread(target=lambda: got.append(listener.accept()), daemon=True)
    waiter.start()
    deadline = time.monotonic() + timeout_s
    while not got:
        waiter.join(1.0)
        if got:
            break
        if not alive():
            raise ActorGone(f"{who} exited before connecting")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{who} did not connect in {timeout_s:.0f} s")
    return got[0]


def connect(address: str, authkey_hex: str) -> Connection:
    """The actor's side of the channel."""
    host, port = address.rsplit(":", 1)
    return Client((host, int(port)), authkey=bytes.fromhex(authkey_hex))
