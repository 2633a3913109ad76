"""Ports: a TCP port free at the time of asking, for a rank's rendezvous or a server.

Input: the host to bind (IPv4 or IPv6; loopback by default). Output: a port number. Another
process may take it before it is used: callers that start a server retry or fail loudly.
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on `host` that was free a moment ago."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port
