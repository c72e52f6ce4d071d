"""Shared tier: KV blocks in a store every instance reaches, below each instance's host and disk
tiers, so a prefix one instance computed is loaded, not computed, by another.

The store is a :class:`BlockStore` (the engine knows nothing of its protocol: a Redis client is in
``backend/cluster/kv_store.py``); a block is one key, ``tdkv:<layout digest>:<hash>``, whose value
is the block in ``kv_block``'s form (checked on every read: a block of another model, layout or
a damaged one is refused, counted and computed again).

What goes in: every full page the engine computes (write-through, as the page joins the prefix
cache), copied when it is registered and written by one writer thread with a bounded queue (a
full queue drops the block, counted); a block this instance wrote or found is not written again.

A store that fails or answers late (each call is bounded by the store's own timeout) is taken as
down for ``retry_s``: logged once per outage, counted, and meanwhile nothing is asked of it
(lookups are misses, writes are dropped); requests compute their KV. Then it is tried again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Protocol

import torch

from backend.engine.block_writer import BlockWriter
from backend.engine.kv_block import BlockCodec

log = logging.getLogger("triton_disagg.engine")

WRITE_QUEUE = 256  # blocks waiting for the writer at most
MAX_KNOWN = 1 << 16  # keys remembered as already in the store


class BlockStore(Protocol):
    """A key-value store shared by the instances (bytes values; each call bounded in time, raising
    on failure)."""

    def exists(self, names: list[str]) -> list[bool]:
        """Whether each of ``names`` is in the store (one round trip)."""

    def get(self, name: str) -> bytes | None: ...
    def put(self, name: str, data: bytes) -> None: ...
    def describe(self) -> str:
        """Where the store is, for logs."""


class SharedTier:
    def __init__(self, store: BlockStore, codec: BlockCodec, retry_s: float = 5.0):
        self.store = store
        self.codec = codec
        self.retry_s = retry_s
        self.prefix = f"tdkv:{codec.digest.hex()}:"
        self.counters = {"hits": 0, "writes": 0, "write_bytes": 0, "dropped": 0, "errors": 0, "corrupt": 0}
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._writer = BlockWriter(self._write, "kv-shared-writer", WRITE_QUEUE)

    def up(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._down_until

    def look_up(self, keys: list[bytes]) -> int:
        """Ask the store how many of the leading ``keys`` it holds (0 while it is down); they are
        then :meth:`held` (one round trip, bounded by the store's timeout: never called on the
        engine's thread)."""
        if not keys or not self.up():
            return 0
        try:
            present = self.store.exists([self.prefix + k.hex() for k in keys])
        except Exception as e:
            self._failed("lookup", e)
            return 0
        n = 0
        while n < len(keys) and present[n]:
            n += 1
        with self._lock:
            for key in keys[:n]:
                self._remember(key)
        return n

    def held(self, keys: list[bytes]) -> int:
        """How many of the leading ``keys`` are known to be in the store (this instance wrote them,
        or a lookup found them), without asking it; 0 while it is down."""
        with self._lock:
            if time.monotonic() < self._down_until:
                return 0
            n = 0
            while n < len(keys) and keys[n] in self._known:
                n += 1
            return n

    def read(self, key: bytes) -> torch.Tensor | None:
        """The block, or None (gone meanwhile, refused, or the store is down)."""
        if not self.up():
            return None
        try:
            data = self.store.get(self.prefix + key.hex())
        except Exception as e:
            self._failed("read", e)
            return None
        if data is None:  # evicted by the store since
            with self._lock:
                self._known.pop(key, None)
            return None
        block, why = self.codec.decode(key, data)
        with self._lock:
            if block is None:
                self.counters["corrupt"] += 1
                self._known.pop(key, None)
            else:
                self.counters["hits"] += 1
        if block is None:
            log.warning("shared KV tier: block %s refused (%s); its KV is computed", key.hex()[:16], why)
        return block

    def wants(self, key: bytes) -> bool:
        """The block is worth copying for :meth:`put` (not known to be in the store, store up)."""
        with self._lock:
            return key not in self._known and time.monotonic() >= self._down_until

    def put(self, key: bytes, block: torch.Tensor) -> None:
        """Queue ``block`` (a CPU copy, not modified afterwards) for the store."""
        if not self._writer.offer(key, block):
            with self._lock:
                self.counters["dropped"] += 1

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued block is written (or dropped); False if ``timeout_s`` passed."""
        return self._writer.drain(timeout_s)

    def stats(self) -> dict:
        with self._lock:
            return {**self.counters, "up": int(time.monotonic() >= self._down_until)}

    def close(self, timeout_s: float = 10.0) -> None:
        self._writer.close(timeout_s)

    # ---------------------------------------------------------------- internals
    def _remember(self, key: bytes) -> None:  # lock held
        self._known[key] = None
        self._known.move_to_end(key)
        while len(self._known) > MAX_KNOWN:
            self._known.popitem(last=False)

    def _failed(self, what: str, e: Exception) -> None:
        with self._lock:
            first = time.monotonic() >= self._down_until
            self._down_until = time.monotonic() + self.retry_s
            self.counters["errors"] += 1
            self._known.clear()  # it may come back empty: its blocks are looked up (and written) again
        if first:
            log.warning(
                "shared KV tier %s: %s failed (%s: %s); not used for %.0f s, requests compute their KV",
                self.store.describe(),
                what,
                type(e).__name__,
                e,
                self.retry_s,
            )

    def _write(self, key: bytes, block: torch.Tensor) -> None:
        if not self.wants(key):
            return
        data = self.codec.encode(key, block)
        try:
            self.store.put(self.prefix + key.hex(), data)
        except Exception as e:
            self._failed("write", e)
            with self._lock:
                self.counters["dropped"] += 1
            return
        with self._lock:
            self.counters["writes"] += 1
            self.counters["write_bytes"] += len(data)
            self._remember(key)
