"""Cache summary: what an instance publishes about its prefix cache and its load, for routers.

``keys`` are the first 8 bytes (little-endian) of the chained page hashes of every page in the
prefix cache (``page_allocator.page_hashes``): a compact summary, 8 bytes a cached page, that a
router matches against a prompt's own page hashes (computed with the published ``salt`` and
``page_size``) without asking the instance. ``version`` changes whenever the set of cached pages
does. A collision of two 64-bit keys can only misroute a request, never corrupt one: the
instance's own allocator, with the full hashes, decides what a request reuses.

On the wire (a decode instance's membership record, a messenger message) it is a JSON object; ``keys`` travel
as base64 of the little-endian uint64 array.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

MAX_SUMMARY_KEYS = 1 << 22  # 32 MiB of keys: far beyond any pool this engine allocates
# at most this many keys in a membership record (128 KiB of keys, about 175 KB of JSON: well under
# etcd's 1.5 MiB request limit)
RECORD_MAX_KEYS = 1 << 14


def page_key(page_hash: bytes) -> int:
    """The 64-bit key of a page hash, as summaries carry it."""
    return int.from_bytes(page_hash[:8], "little")


@dataclass(frozen=True)
class CacheSummary:
    salt: str  # hex of the page-hash salt: model, dtype, TP layout, page size
    page_size: int
    version: int
    keys: frozenset[int]
    total_pages: int
    free_pages: int  # free and evictable cached pages: what a new request can get
    running: int  # requests in the engine (running and waiting)
    waiting: int  # requests the instance holds that the engine has not taken yet (queues)
    tier_keys: frozenset[int] = frozenset()  # blocks in its host and disk tiers (kv_tiers.py)

    def to_json(self, max_keys: int | None = None) -> dict:
        """The wire form; ``max_keys``: at most that many keys, the pool's first (an arbitrary
        subset: a router then misses some cached pages, which only costs it a better pick)."""
        count = len(self.keys) if max_keys is None else min(len(self.keys), max_keys)
        keys = np.fromiter(self.keys, dtype="<u8", count=count)
        left = len(self.tier_keys) if max_keys is None else min(len(self.tier_keys), max_keys - count)
        tier_keys = np.fromiter(self.tier_keys, dtype="<u8", count=left)
        return {
            "salt": self.salt,
            "page_size": self.page_size,
            "version": self.version,
            "keys": base64.b64encode(keys.tobytes()).decode(),
            "tier_keys": base64.b64encode(tier_keys.tobytes()).decode(),
            "total_pages": self.total_pages,
            "free_pages": self.free_pages,
            "running": self.running,
            "waiting": self.waiting,
        }

    @classmethod
    def from_json(cls, obj) -> "CacheSummary":
        """A validated summary; ValueError says what is wrong."""
        if not isinstance(obj, dict):
            raise ValueError("a cache summary must be an object")
        fields = (
            "salt",
            "page_size",
            "version",
            "keys",
            "total_pages",
            "free_pages",
            "running",
            "waiting",
            "tier_keys",
        )
        extra, missing = sorted(set(obj) - set(fields)), [f for f in fields if f not in obj]
        if extra or missing:
            raise ValueError(f"cache summary: unknown fields {extra}, missing fields {missing}")
        for name in fields[1:3] + fields[4:8]:
            v = obj[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"cache summary: {name} must be a non-negative integer, got {v!r}")
        if obj["page_size"] < 1:
            raise ValueError("cache summary: page_size must be >= 1")
        if not all(isinstance(obj[f], str) for f in ("salt", "keys", "tier_keys")):
            raise ValueError("cache summary: salt, keys and tier_keys must be strings")
        try:
            bytes.fromhex(obj["salt"])
        except ValueError as e:
            raise ValueError(f"cache summary: bad salt encoding: {e}") from None
        keys, tier_keys = _keys(obj["keys"], "keys"), _keys(obj["tier_keys"], "tier_keys")
        return cls(
            obj["salt"],
            obj["page_size"],
            obj["version"],
            keys,
            total_pages=obj["total_pages"],
            free_pages=obj["free_pages"],
            running=obj["running"],
            waiting=obj["waiting"],
            tier_keys=tier_keys,
        )


def _keys(text: str, name: str) -> frozenset[int]:
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError as e:
        raise ValueError(f"cache summary: bad {name} encoding: {e}") from None
    if len(raw) % 8 or len(raw) // 8 > MAX_SUMMARY_KEYS:
        raise ValueError(f"cache summary: {name} are {len(raw)} bytes, not a multiple of 8 up to {MAX_SUMMARY_KEYS}")
    return frozenset(int(k) for k in np.frombuffer(raw, dtype="<u8"))
