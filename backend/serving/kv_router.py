"""KV-aware router: picks the instance for a prompt by the KV it would reuse there and the load
already on it, from the cache summaries instances publish (``engine/cache_summary.py``), with no
round trip per request. The front model routes to decode models with one; each decode instance
picks its prefill instance with another.

``cost = overlap_weight x uncached prompt pages + pages of this router's requests in flight there``
(NVIDIA Dynamo's KV router weighs prefill and decode blocks the same way). A prompt page in the
instance's host or disk tier (the summary's ``tier_keys``, matched after its pool's pages) counts
as :data:`TIER_PAGE_COST` of an uncached page: it is copied into the pool, not computed (a copy
of a page's KV for every layer takes about 0.1 ms here against milliseconds to compute it), and
the pool's own pages still win a tie. Lowest cost wins; ties
go to fewer requests in flight, then round-robin. An instance whose last summary says it has
fewer free pages than the request needs goes after every instance that has them. With
``overlap_weight`` 0 it is least-loaded routing (by pages in flight).

What can go stale, and what happens then: a summary is as old as its publishing period (the
decode instances' membership records, the prefill instances' cache reports). Between summaries the router
counts the pages of each prompt it routed to an instance as cached there for ``predict_ttl_s``
(they will be once its prefill is done), so a burst of requests sharing a prefix goes to one
instance. A stale summary can claim a prefix that was evicted since (that request computes or
fetches more: slower, same output) or miss one gained since (that request reuses less). The
instance's own page allocator alone decides what a request reuses, so routing never changes an
output. An instance with no summary yet counts as caching nothing.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Hashable, Sequence

from backend.engine.cache_summary import CacheSummary, page_key
from backend.engine.page_allocator import chain_start, page_hashes

TIER_PAGE_COST = 0.1  # a prompt page in an instance's host or disk tier, against an uncached one (1)


class KVRouter:
    def __init__(self, overlap_weight: float = 1.0, predict_ttl_s: float = 10.0):
        if overlap_weight < 0:
            raise ValueError(f"overlap_weight must be >= 0, got {overlap_weight}")
        self.overlap_weight = overlap_weight
        self.predict_ttl_s = predict_ttl_s
        self._summaries: dict[str, CacheSummary] = {}
        self._predicted: dict[str, dict[int, float]] = {}  # name -> key -> when it was routed there
        self._inflight: dict[str, dict[Hashable, int]] = {}  # name -> request -> its pages
        self._rr = itertools.count()
        self._lock = threading.Lock()
        # prompt tokens routed, and how many of them the chosen instance was judged to hold
        self.counters = {"query_tokens": 0, "predicted_hit_tokens": 0}

    # ------------------------------------------------------------ what instances publish
    def update(self, name: str, summary: CacheSummary) -> None:
        now = time.monotonic()
        with self._lock:
            self._summaries[name] = summary
            predicted = self._predicted.get(name, {})
            self._predicted[name] = {
                k: t for k, t in predicted.items() if now - t < self.predict_ttl_s and k not in summary.keys
            }

    def forget(self, name: str) -> None:
        """``name`` is gone (down, disconnected): nothing is known cached there and nothing is in
        flight there any more (it may come back empty)."""
        with self._lock:
            self._summaries.pop(name, None)
            self._predicted.pop(name, None)
            self._inflight.pop(name, None)

    def page_size(self) -> int:
        """The page size the instances report (before any has: 16)."""
        with self._lock:
            return next(iter(self._summaries.values())).page_size if self._summaries else 16

    def summary(self, name: str) -> CacheSummary | None:
        with self._lock:
            return self._summaries.get(name)

    # ------------------------------------------------------------ routing
    def cached_tokens(self, name: str, token_ids: Sequence[int], cache_salt: str = "") -> int:
        """Tokens of the prompt ``token_ids`` that ``name`` is judged to hold (whole pages, never
        the last token, as the page allocator attaches them)."""
        with self._lock:
            return sum(self._matched_pages(name, token_ids, cache_salt, time.monotonic(), {})) * self._page_size(name)

    def pick(
        self,
        request: Hashable,
        token_ids: Sequence[int],
        candidates: Sequence[str],
        request_pages: int,
        cache_salt: str = "",
    ) -> str | None:
        """The cheapest of ``candidates`` for the prompt ``token_ids`` (None if there are none);
        the request counts as in flight there (``request_pages`` pages) until :meth:`done`. Its
        ``cache_salt`` (prefix-cache tenant) matches only pages cached under the same salt."""
        if not candidates:
            return None
        now = time.monotonic()
        start = next(self._rr) % len(candidates)
        order = list(candidates[start:]) + list(candidates[:start])
        keys: dict = {}  # the prompt's page keys by (salt, page size), computed once
        with self._lock:
            ranked = []
            for i, name in enumerate(order):
                matched, in_tiers = (
                    self._matched_pages(name, token_ids, cache_salt, now, keys) if self.overlap_weight else (0, 0)
                )
                page_size = self._page_size(name)
                uncached = -(-len(token_ids) // page_size) - matched - in_tiers + TIER_PAGE_COST * in_tiers
                inflight = self._inflight.get(name, {})
                summary = self._summaries.get(name)
                short = summary is not None and summary.free_pages < request_pages
                cost = self.overlap_weight * uncached + sum(inflight.values())
                ranked.append(((short, cost, len(inflight), i), name, (matched + in_tiers) * page_size))
            _, best, hit = min(ranked)
            self._inflight.setdefault(best, {})[request] = request_pages
            self.counters["query_tokens"] += len(token_ids)
            self.counters["predicted_hit_tokens"] += hit
            if self.overlap_weight:
                self._predict(best, token_ids, cache_salt, now, keys)
        return best

    def done(self, name: str, request: Hashable) -> None:
        with self._lock:
            self._inflight.get(name, {}).pop(request, None)

    def inflight(self, name: str) -> int:
        with self._lock:
            return len(self._inflight.get(name, {}))

    # ------------------------------------------------------------ internals (lock held)
    def _page_size(self, name: str) -> int:
        summary = self._summaries.get(name)
        return summary.page_size if summary is not None else 16

    @staticmethod
    def _prompt_keys(summary: CacheSummary, token_ids: Sequence[int], cache_salt: str, memo: dict) -> list[int]:
        at = (summary.salt, summary.page_size)
        if at not in memo:
            ids = list(token_ids)[: max(len(token_ids) - 1, 0)]
            start = chain_start(bytes.fromhex(summary.salt), cache_salt)
            memo[at] = [page_key(h) for h in page_hashes(ids, summary.page_size, start)]
        return memo[at]

    def _matched_pages(
        self, name: str, token_ids: Sequence[int], cache_salt: str, now: float, memo: dict
    ) -> tuple[int, int]:
        """(prompt pages ``name`` holds in its pool, or was sent lately; the pages after those in
        its host or disk tier)."""
        summary = self._summaries.get(name)
        if summary is None:
            return 0, 0
        predicted = self._predicted.get(name, {})
        matched = in_tiers = 0
        for key in self._prompt_keys(summary, token_ids, cache_salt, memo):
            if not in_tiers and (key in summary.keys or now - predicted.get(key, -1e18) < self.predict_ttl_s):
                matched += 1
            elif key in summary.tier_keys:
                in_tiers += 1
            else:
                break
        return matched, in_tiers

    def _predict(self, name: str, token_ids: Sequence[int], cache_salt: str, now: float, memo: dict) -> None:
        summary = self._summaries.get(name)
        if summary is not None:
            predicted = self._predicted.setdefault(name, {})
            for key in self._prompt_keys(summary, token_ids, cache_salt, memo):
                if key not in summary.keys:
                    predicted[key] = now
