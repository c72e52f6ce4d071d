"""The shared KV tier's store: Redis (or Valkey, which speaks the same protocol), reached with
the ``redis`` client, each call bounded by ``timeout_s``. Implements the engine's ``BlockStore``
(``backend/engine/shared_tier.py``): a block is one key, its value the block's bytes.

Why Redis: Debian packages it (``redis-server`` 7.0), it runs as one plain process on a CPU
machine with TCP, keeps values of any size in memory with a size bound and least-recently-used
eviction of its own (``--maxmemory``, ``--maxmemory-policy allkeys-lru``), and a pipeline asks
for the existence of a prompt's blocks in one round trip. Mooncake Store (what SGLang's HiCache
and vLLM use for this tier) moves blocks over RDMA with its own master and metadata services;
over TCP on a CPU machine it was measured beside Redis (``perf/history/experiments.md``: puts slower,
gets about even, two processes and 115 MB before any block, libibverbs needed even for TCP).
"""

from __future__ import annotations

from urllib.parse import urlparse

import redis


class RedisBlockStore:
    def __init__(self, url: str, timeout_s: float = 0.5):
        parsed = urlparse(url)
        if parsed.scheme not in ("redis", "rediss", "valkey") or not parsed.hostname:
            raise ValueError(f"kv_store_url must be redis://HOST:PORT[/DB] (or valkey://), got {url!r}")
        self.url = url
        self._client = redis.Redis.from_url(
            url.replace("valkey://", "redis://", 1), socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )

    def exists(self, names: list[str]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return [bool(n) for n in pipe.execute()]

    def get(self, name: str) -> bytes | None:
        value = self._client.get(name)
        return bytes(value) if value is not None else None  # type: ignore[arg-type]

    def put(self, name: str, data: bytes) -> None:
        self._client.set(name, data)

    def describe(self) -> str:
        return self.url
