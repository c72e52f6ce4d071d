"""Page allocator: free list, per-request page tables, page commitments, and the prefix cache.

Pages held by a request are pinned: nothing a request holds is ever evicted or preempted. To
make that safe, a request *commits* the pages it may grow into (prompt + max new tokens) when
it is admitted; the commitments never exceed the pool, so a running request can always extend
its table and a request that does not fit simply waits. All methods are thread-safe (the decode
role reserves pages from another thread while the engine loop runs).

Prefix caching (``prefix_caching=True``): a *full* page whose KV the engine has computed is
keyed by a chained hash of the token ids up to its end (:func:`page_hashes`, salted with what
changes the KV: model, dtype, TP layout, page size). Pages carry reference counts; a request
admitted with ``token_ids`` attaches the longest run of cached pages that starts its prompt
(never its last token: that one is always computed, for its logits) and computes only the
rest. A page nobody holds any more stays cached, in LRU order, and is evicted only when a
request needs a page and the free list is empty. Partial pages are never shared; a page is
registered only after the engine has computed all of it (:meth:`PageAllocator.register`), so
pages a transfer is still writing, or that a failed transfer left half-written, are never in
the cache; a held page is never evicted. Commitments count shared pages once per holder, which
over-counts and so stays safe. ``stats()["free"]`` counts free and evictable cached pages (what
a new request can get).

Tiers (``tiers``, see ``kv_tiers.py``): a cached page that is evicted is handed to the tiers
(:meth:`PageTiers.spill`, with the lock held: the page is about to be reused); when a prompt's
prefix goes on past the pool's pages, the blocks the tiers hold next get pages of their own, which
the request holds while the engine loads them (:meth:`PageAllocator.tier_loads`); once loaded
(:meth:`PageAllocator.tier_loaded`) they count as cached tokens and join the prefix cache.

A request's ``cache_salt`` (tenants that must not share KV) starts its hash chain elsewhere
(:func:`chain_start`): its pages match only requests with the same salt.

The free list is a min-heap: a request gets the lowest-numbered free pages, so a fresh or
lightly used pool hands out runs of adjacent pages, which a KV transfer moves as one
descriptor per run (NIXL merges descriptors adjacent on both sides).
"""

from __future__ import annotations

import hashlib
import heapq
import threading
from collections import OrderedDict
from typing import Any, Protocol

import numpy as np

from backend.engine.cache_summary import page_key


class PoolFullError(RuntimeError):
    """The pool cannot hold (or commit) the pages asked for right now."""


def page_hashes(token_ids, page_size: int, salt: bytes, first: int = 0, prev: bytes | None = None) -> list[bytes]:
    """Chained hashes of the full pages ``first, first+1, ...`` of ``token_ids`` (``prev``: the
    hash of page ``first - 1``; the chain starts from ``salt``). Stable across processes."""
    out, h = [], prev if prev is not None else salt
    tokens = np.asarray(token_ids, dtype=np.int64)
    for i in range(first, len(tokens) // page_size):
        h = hashlib.blake2b(h + tokens[i * page_size : (i + 1) * page_size].tobytes(), digest_size=16).digest()
        out.append(h)
    return out


def chain_start(salt: bytes, cache_salt: str = "") -> bytes:
    """Where a request's hash chain starts: the instance's ``salt``, with the request's
    ``cache_salt`` (if any) folded in."""
    if not cache_salt:
        return salt
    return hashlib.blake2b(salt + b"|cache_salt|" + cache_salt.encode(), digest_size=16).digest()


class PageTiers(Protocol):
    """What the allocator asks of the KV tiers below the pool (``kv_tiers.KVTiers``)."""

    def spill(self, key: bytes, page: int) -> None:
        """A cached page is evicted: keep its KV (called with the allocator's lock held)."""

    def hit(self, keys: list[bytes]) -> None:
        """These pages served a prompt's prefix from the pool."""

    def computed(self, key: bytes, page: int) -> None:
        """The engine computed this full page (called with the allocator's lock held)."""

    def find(self, keys: list[bytes]) -> list:
        """A handle for each of the leading ``keys`` some tier holds, up to the first miss (never
        waits on I/O: it is called with the allocator's lock held)."""


class PageAllocator:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        prefix_caching: bool = False,
        salt: bytes = b"",
        tiers: PageTiers | None = None,
    ):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self.salt = salt
        self.tiers = tiers if prefix_caching else None
        self._free = list(range(num_pages))  # a min-heap (sorted is one)
        self._ref = [0] * num_pages
        self._tables: dict[str, list[int]] = {}
        self._committed: dict[str, int] = {}
        self._committed_total = 0
        # prefix cache: hash <-> page for computed full pages; unreferenced cached pages in LRU order
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._hashed: dict[str, tuple[int, bytes | None]] = {}  # req -> (pages hashed, last hash)
        self._cached_tokens: dict[str, int] = {}
        self._tier_loads: dict[str, list[tuple[int, bytes, Any]]] = {}  # req -> (page, hash, handle)
        self.counters = {"query_tokens": 0, "hit_tokens": 0, "tier_hit_tokens": 0, "evictions": 0}
        self._version = 0  # bumped whenever the set of cached pages changes
        self._keys: tuple[int, frozenset[int]] = (0, frozenset())  # cached_keys() of that version
        self._lock = threading.Lock()

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def allocate(
        self, req_id: str, n_tokens: int, commit_tokens: int = 0, token_ids=None, cache_salt: str = ""
    ) -> list[int]:
        """Create ``req_id``'s table with pages for ``n_tokens``, committing room for
        ``max(n_tokens, commit_tokens)`` tokens. With prefix caching and ``token_ids`` (the
        prompt), the table starts with the cached pages of its longest cached prefix
        (:meth:`cached_tokens` says how many tokens they hold), then pages for the blocks of the
        prefix that the tiers hold (:meth:`tier_loads`). Raises :class:`PoolFullError` if that
        does not fit."""
        with self._lock:
            if req_id in self._tables:
                raise ValueError(f"request {req_id!r} already holds pages")
            n_pages = self.pages_for(n_tokens)
            commit = max(n_pages, self.pages_for(commit_tokens))
            if commit > self.num_pages - self._committed_total:
                raise PoolFullError(
                    f"request {req_id!r} needs {commit} pages; "
                    f"{self.num_pages - self._committed_total} of {self.num_pages} uncommitted"
                )
            table: list[int] = []
            last = chain_start(self.salt, cache_salt)
            loads: list[tuple[int, bytes, Any]] = []
            if self.prefix_caching and token_ids is not None and len(token_ids) > 1:
                self.counters["query_tokens"] += len(token_ids)
                hashes = page_hashes(token_ids[: len(token_ids) - 1], self.page_size, last)[:n_pages]
                for h in hashes:
                    page = self._page_of.get(h)
                    if page is None:
                        break
                    self._hold(page)
                    table.append(page)
                    last = h
                self.counters["hit_tokens"] += len(table) * self.page_size
                if self.tiers is not None:
                    self.tiers.hit(hashes[: len(table)])
                    rest = hashes[len(table) :]
                    found = self.tiers.find(rest) if rest else []
                    loads = [(self._take(), h, handle) for h, handle in zip(rest, found)]
            self._hashed[req_id] = (len(table), last)
            self._cached_tokens[req_id] = len(table) * self.page_size
            if loads:
                self._tier_loads[req_id] = loads
            table.extend(page for page, _, _ in loads)
            table.extend(self._take() for _ in range(n_pages - len(table)))
            self._tables[req_id] = table
            self._committed[req_id] = commit
            self._committed_total += commit
            return list(table)

    def uncached_keys(self, token_ids, cache_salt: str = "") -> list[bytes]:
        """The page hashes of the prompt ``token_ids`` (its full pages, never the last token)
        past the pool's cached prefix: what the tiers may hold of it ([] without prefix caching)."""
        if not self.prefix_caching or len(token_ids) < 2:
            return []
        hashes = page_hashes(token_ids[: len(token_ids) - 1], self.page_size, chain_start(self.salt, cache_salt))
        with self._lock:
            n = 0
            while n < len(hashes) and hashes[n] in self._page_of:
                n += 1
        return hashes[n:]

    def tier_loads(self, req_id: str) -> list[tuple[int, bytes, Any]]:
        """``(page, hash, handle)`` of the blocks of ``req_id``'s prefix that the tiers hold, in
        order, right after its cached pages: the engine loads them, then :meth:`tier_loaded`."""
        with self._lock:
            return list(self._tier_loads.get(req_id, ()))

    def tier_loaded(self, req_id: str, loaded: int) -> None:
        """The first ``loaded`` of ``req_id``'s tier blocks are in their pages: they count as
        cached tokens and join the prefix cache (the rest are plain pages, computed)."""
        with self._lock:
            loads = self._tier_loads.pop(req_id, [])
            if req_id not in self._tables or not loads:
                return
            done, prev = self._hashed[req_id]
            for page, h, _ in loads[:loaded]:
                if h not in self._page_of and page not in self._hash_of:
                    self._page_of[h] = page
                    self._hash_of[page] = h
                    self._version += 1
                prev = h
            self._hashed[req_id] = (done + loaded, prev)
            self._cached_tokens[req_id] += loaded * self.page_size
            self.counters["hit_tokens"] += loaded * self.page_size
            self.counters["tier_hit_tokens"] += loaded * self.page_size

    def cached_tokens(self, req_id: str) -> int:
        """Tokens of ``req_id``'s prompt found in the cache at allocation (their KV is in its pages)."""
        with self._lock:
            return self._cached_tokens.get(req_id, 0)

    def register(self, req_id: str, token_ids, num_computed: int) -> None:
        """The engine has computed the KV of ``token_ids[:num_computed]`` into ``req_id``'s pages:
        its full pages become cached (a page whose hash another page holds already stays private)."""
        if not self.prefix_caching:
            return
        with self._lock:
            table = self._tables.get(req_id)
            if table is None:
                return
            done, prev = self._hashed.get(req_id, (0, None))
            n_full = min(num_computed // self.page_size, len(table))
            if n_full <= done:
                return
            for i, h in enumerate(
                page_hashes(token_ids[: n_full * self.page_size], self.page_size, self.salt, done, prev)
            ):
                page = table[done + i]
                if h not in self._page_of and page not in self._hash_of:
                    self._page_of[h] = page
                    self._hash_of[page] = h
                    self._version += 1
                    if self.tiers is not None:
                        self.tiers.computed(h, page)
                prev = h
            self._hashed[req_id] = (n_full, prev)

    def extend(self, req_id: str, n_tokens: int) -> list[int]:
        """Grow ``req_id``'s table to cover ``n_tokens`` tokens; returns the pages added."""
        with self._lock:
            table = self._table(req_id)
            missing = self.pages_for(n_tokens) - len(table)
            if missing <= 0:
                return []
            over = len(table) + missing - self._committed[req_id]
            if over > 0:
                if over > self.num_pages - self._committed_total:
                    raise PoolFullError(f"request {req_id!r} cannot grow by {missing} pages: pool fully committed")
                self._committed[req_id] += over
                self._committed_total += over
            added = [self._take() for _ in range(missing)]
            table.extend(added)
            return added

    def shrink(self, req_id: str, n_tokens: int) -> int:
        """Free ``req_id``'s pages beyond those ``n_tokens`` tokens need (rejected draft tokens);
        its commitment stays, so it can grow again. Returns how many pages were freed."""
        with self._lock:
            table = self._table(req_id)
            keep = self.pages_for(n_tokens)
            freed = table[keep:]
            del table[keep:]
            for page in freed:  # never cached ones: they hold only rejected drafts' tokens
                self._release(page)
            return len(freed)

    def commit(self, req_id: str, commit_tokens: int) -> None:
        """Raise ``req_id``'s commitment to ``commit_tokens`` tokens (PoolFullError if it can't)."""
        with self._lock:
            self._table(req_id)
            extra = self.pages_for(commit_tokens) - self._committed[req_id]
            if extra <= 0:
                return
            if extra > self.num_pages - self._committed_total:
                raise PoolFullError(f"request {req_id!r} cannot commit {extra} more pages")
            self._committed[req_id] += extra
            self._committed_total += extra

    def free(self, req_id: str) -> int:
        """Let go of all of ``req_id``'s pages (cached ones stay cached until evicted). Unknown or
        already freed: KeyError."""
        with self._lock:
            table = self._table(req_id)
            del self._tables[req_id]
            self._committed_total -= self._committed.pop(req_id)
            self._hashed.pop(req_id, None)
            self._cached_tokens.pop(req_id, None)
            self._tier_loads.pop(req_id, None)
            for page in table:
                self._release(page)
            return len(table)

    def has(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._tables

    def page_table(self, req_id: str) -> list[int]:
        with self._lock:
            return list(self._table(req_id))

    def cached_keys(self) -> tuple[int, frozenset[int]]:
        """(version, the 64-bit keys of every cached page's hash): what a router matches against
        (``cache_summary.py``). The version changes whenever the set does; the set is built once
        per version."""
        with self._lock:
            if self._keys[0] != self._version:
                self._keys = (self._version, frozenset(page_key(h) for h in self._page_of))
            return self._keys

    def cached_pages(self) -> list[tuple[bytes, int]]:
        """(hash, page) of every page in the prefix cache."""
        with self._lock:
            return list(self._page_of.items())

    def stats(self) -> dict:
        with self._lock:
            free = len(self._free) + len(self._lru)  # evictable cached pages count as free
            return {
                "total": self.num_pages,
                "free": free,
                "used": self.num_pages - free,
                "requests": len(self._tables),
                "committed": self._committed_total,
                "page_size": self.page_size,
                "cached": len(self._hash_of),
                "prefix_query_tokens": self.counters["query_tokens"],
                "prefix_hit_tokens": self.counters["hit_tokens"],
                "prefix_tier_hit_tokens": self.counters["tier_hit_tokens"],
                "prefix_evictions": self.counters["evictions"],
            }

    # ---------------------------------------------------------------- internals (lock held)
    def _take(self) -> int:
        if self._free:
            page = heapq.heappop(self._free)
        elif self._lru:
            page, _ = self._lru.popitem(last=False)  # the least recently used cached page
            h = self._hash_of.pop(page)
            del self._page_of[h]
            self.counters["evictions"] += 1
            if self.tiers is not None:
                self.tiers.spill(h, page)
            self._version += 1
        else:  # commitments make this unreachable
            raise PoolFullError("no free page left")
        self._ref[page] = 1
        return page

    def _hold(self, page: int) -> None:
        if self._ref[page] == 0:
            self._lru.pop(page, None)
        self._ref[page] += 1

    def _release(self, page: int) -> None:
        self._ref[page] -= 1
        if self._ref[page] == 0:
            if page in self._hash_of:
                self._lru[page] = None
            else:
                heapq.heappush(self._free, page)

    def _table(self, req_id: str) -> list[int]:
        table = self._tables.get(req_id)
        if table is None:
            raise KeyError(f"request {req_id!r} holds no pages (unknown or already freed)")
        return table
