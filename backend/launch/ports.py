"""Free TCP ports for the servers and messengers a deployment starts."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, chosen below the ephemeral range so that outgoing connections (which
    take ephemeral ports) cannot grab it between now and the server binding it."""
    lo = min(_ephemeral_range()[0], 32768)
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(max(1024, lo - 12000), lo)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port found below the ephemeral range")
