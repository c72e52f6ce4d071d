"""KV tiers below the pool: what the page allocator keeps when it evicts a cached page, finds when
a prompt's prefix is not in the pool, and the loader thread that copies found blocks into pages.

The chain is pool -> host tier (``host_tier.py``) -> disk tier (``disk_tier.py``) -> shared tier
(``shared_tier.py``, a store every instance reaches; every page the engine computes is written
there too, :meth:`KVTiers.computed`). A cached page
the allocator evicts is copied into the host tier (:meth:`KVTiers.spill`); a block the host tier
pushes out moves on to the disk tier if it was hit at least ``admit_hits`` times (a hit: the block
served a prompt's prefix from any tier, the pool included); at close, the pool's and the host
tier's blocks hit that often are written to disk too, so a restarted instance finds them.

When a prompt's prefix continues past the pool's pages, the allocator asks :meth:`KVTiers.find`
which of the next blocks a tier holds (in order, up to the first miss), takes a page for each and
hands the list to the engine, which parks the request and queues the copies on the loader thread
(:meth:`KVTiers.load`); the engine's steps go on meanwhile. The loader reports ``(request, blocks
loaded)`` (:meth:`KVTiers.finished`): a block that cannot be read (a damaged file) ends the
request's load there, and the rest of its prompt is computed. ``waker`` is called from the loader
thread when a result is ready (the engine loop wakes up for it).

The shared tier is a network round trip away, so :meth:`find` never asks it: when a request
arrives whose prefix the pool, host and disk tiers do not hold whole, the engine asks the store
first (:meth:`look_up`, on the lookup thread; the request waits meanwhile, holding nothing, and
:meth:`looked_up` reports it), and :meth:`find` counts the blocks the store is known to hold
(those looked up, and those this instance wrote).

Blocks are copied with the allocator's lock held when spilled (the page is about to be reused);
loads copy into pages that only the loading request holds.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from backend.engine.cache_summary import page_key
from backend.engine.disk_tier import DiskTier
from backend.engine.host_tier import HostTier
from backend.engine.kv_pool import KVPool
from backend.engine.shared_tier import SharedTier

log = logging.getLogger("triton_disagg.engine")

MAX_COUNTED = 1 << 16  # blocks whose hit counts are remembered (least recently hit forgotten)
FLUSH_S = 10.0  # at close, how long the tiers may write blocks to disk at most


DISK, SHARED = "disk", "shared"  # where a found block is read from (a host-tier block is itself)
HOST = "host"  # the host tier, in the per-tier figures


@dataclass(frozen=True)
class TierLoad:
    """One block to copy into ``page``: the host tier's ``block``, or read from :data:`DISK` or
    :data:`SHARED`."""

    page: int
    key: bytes
    block: torch.Tensor | str

    def on(self, tier: str) -> bool:
        """The block is read from ``tier`` (:data:`DISK` or :data:`SHARED`)."""
        return isinstance(self.block, str) and self.block == tier


class KVTiers:
    def __init__(
        self, pool: KVPool, host_blocks: int, disk: DiskTier | None, admit_hits: int, shared: SharedTier | None = None
    ):
        self.pool = pool
        self.host = HostTier(host_blocks) if host_blocks > 0 else None
        self.disk = disk
        self.shared = shared
        self.admit_hits = admit_hits
        self.waker: Callable[[], None] = lambda: None
        self.counters = {
            "host_hit_blocks": 0,
            "disk_hit_blocks": 0,
            "spilled_blocks": 0,
            "load_failures": 0,
            # a tier asked for a block (a prompt's, past the pool's pages) that it does not hold
            "host_miss_blocks": 0,
            "disk_miss_blocks": 0,
            "shared_miss_blocks": 0,
            "host_evicted_blocks": 0,  # pushed out of the host tier (on to the disk tier if hit enough)
        }
        self.load_seconds = 0.0
        self.tier_seconds = {HOST: 0.0, DISK: 0.0, SHARED: 0.0}  # of load_seconds: reading and copying per tier
        page = pool.tensor[:, 0]
        self.block_bytes = page.numel() * page.element_size()
        self._hits: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[str, list[TierLoad]] | None] = queue.SimpleQueue()
        self._done: list[tuple[str, int]] = []
        self._done_event = threading.Event()
        self._in_flight = 0
        self._flush_deadline = 0.0
        self._keys: tuple[int, frozenset[int]] = (-1, frozenset())
        self._loader = threading.Thread(target=self._load_loop, name="kv-tier-loader", daemon=True)
        self._loader.start()
        self._lookups: queue.SimpleQueue[tuple[str, list[bytes]] | None] = queue.SimpleQueue()
        self._looked_up: list[str] = []
        if shared is not None:
            self._looker = threading.Thread(target=self._look_up_loop, name="kv-shared-lookup", daemon=True)
            self._looker.start()

    # ---------------------------------------------------------------- the allocator's side
    def spill(self, key: bytes, page: int) -> None:
        """A cached page is evicted from the pool: keep its block."""
        block = self._block_of(page)
        with self._lock:
            self.counters["spilled_blocks"] += 1
        if self.host is not None:
            pushed_out = self.host.put(key, block)
            with self._lock:
                self.counters["host_evicted_blocks"] += len(pushed_out)
            for out_key, out_block in pushed_out:
                self._admit(out_key, out_block)
        else:
            self._admit(key, block)

    def hit(self, keys: list[bytes]) -> None:
        """These blocks served a prompt's prefix (from the pool)."""
        with self._lock:
            for key in keys:
                self._hits[key] = self._hits.pop(key, 0) + 1
            while len(self._hits) > MAX_COUNTED:
                self._hits.popitem(last=False)

    def computed(self, key: bytes, page: int) -> None:
        """The engine computed this full page (it joins the prefix cache): the shared tier gets it."""
        if self.shared is not None and self.shared.wants(key):
            self.shared.put(key, self._block_of(page))

    def find(self, keys: list[bytes]) -> list[torch.Tensor | str]:
        """Where the leading ``keys`` are, up to the first that no tier holds: the host tier's
        block, :data:`DISK` or :data:`SHARED`."""
        found = self._private(keys)
        if self.shared is not None and len(found) < len(keys):
            found += [SHARED] * self.shared.held(keys[len(found) :])
            if len(found) < len(keys):
                with self._lock:
                    self.counters["shared_miss_blocks"] += 1
        self.hit(keys[: len(found)])
        return found

    def look_up(self, req_id: str, keys: list[bytes]) -> bool:
        """Ask the shared tier, on the lookup thread, which of a prompt's ``keys`` (its blocks past
        the pool's) it holds, unless the host and disk tiers, or what is known of the store, cover
        them already; True if it is asked (:meth:`looked_up` reports ``req_id`` when answered)."""
        if self.shared is None or not keys or not self.shared.up():
            return False
        held = 0
        while held < len(keys) and (
            (self.host is not None and keys[held] in self.host) or (self.disk is not None and self.disk.has(keys[held]))
        ):
            held += 1
        rest = keys[held:]
        if not rest or self.shared.held(rest) == len(rest):
            return False
        with self._lock:
            self._in_flight += 1
        self._lookups.put((req_id, rest))
        return True

    def looked_up(self) -> list[str]:
        """The requests whose lookups were answered since the last call."""
        with self._lock:
            done, self._looked_up = self._looked_up, []
            if not self._done:
                self._done_event.clear()
            return done

    # ---------------------------------------------------------------- the engine's side
    def load(self, req_id: str, loads: list[TierLoad]) -> None:
        """Copy ``loads`` into their pages on the loader thread; :meth:`finished` reports it."""
        with self._lock:
            self._in_flight += 1
        self._jobs.put((req_id, loads))

    def finished(self) -> list[tuple[str, int]]:
        """(request, how many of its blocks were loaded, in order) for every load done since the
        last call."""
        with self._lock:
            done, self._done = self._done, []
            if not self._looked_up:
                self._done_event.clear()
            return done

    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def wait(self, timeout_s: float) -> bool:
        """Block until a load or lookup is done (True) or ``timeout_s`` passed."""
        return self._done_event.wait(timeout_s)

    def flush(self, cached: list[tuple[bytes, int]], within_s: float = FLUSH_S) -> None:
        """At close: the pool's cached pages (``(hash, page)``) and the host tier's blocks that were
        hit at least ``admit_hits`` times go to the disk tier, most recently hit first, for at most
        ``within_s`` (what is not written by then is lost with the process)."""
        if self.disk is None:
            return
        deadline = time.monotonic() + within_s
        host = self.host.items() if self.host is not None else []
        blocks: list[tuple[bytes, int | torch.Tensor]] = [
            (k, p) for k, p in cached if self._hit_count(k) >= self.admit_hits
        ]
        blocks += [(k, b) for k, b in host if self._hit_count(k) >= self.admit_hits]
        with self._lock:  # most recently hit first
            order = {k: i for i, k in enumerate(self._hits)}
        blocks.sort(key=lambda kb: -order.get(kb[0], -1))
        for key, where in blocks:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("KV tiers: flush to disk stopped after %.0f s", within_s)
                break
            block = self._block_of(where) if isinstance(where, int) else where
            self.disk.put(key, block, wait_s=left)
        self._flush_deadline = deadline

    def close(self) -> None:
        self._jobs.put(None)
        self._lookups.put(None)
        self._loader.join(10)
        if self.disk is not None:
            self.disk.close(max(1.0, self._flush_deadline - time.monotonic()))
        if self.shared is not None:
            self.shared.close()

    def keys(self) -> tuple[int, frozenset[int]]:
        """(version, the 64-bit keys of the blocks in the host and disk tiers): what a router
        matches a prompt against after the pool's pages (``cache_summary.py``). The set is built
        again only when the tiers' version changed."""
        version = (self.host.version if self.host is not None else 0) + (self.disk.version if self.disk else 0)
        if self._keys[0] != version:
            held = (self.host.keys() if self.host is not None else []) + (self.disk.keys() if self.disk else [])
            self._keys = (version, frozenset(page_key(k) for k in held))
        return self._keys

    def stats(self) -> dict:
        with self._lock:
            out = dict(self.counters, load_seconds=self.load_seconds, block_bytes=self.block_bytes)
            out.update({f"{tier}_load_seconds": seconds for tier, seconds in self.tier_seconds.items()})
        out["host_blocks"] = len(self.host) if self.host is not None else 0
        out["host_capacity_blocks"] = self.host.capacity_blocks if self.host is not None else 0
        if self.disk is not None:
            out.update({f"disk_{k}": v for k, v in self.disk.stats().items()})
        if self.shared is not None:
            out.update({f"shared_{k}": v for k, v in self.shared.stats().items()})
        return out

    # ---------------------------------------------------------------- internals
    def _private(self, keys: list[bytes]) -> list[torch.Tensor | str]:
        """The host tier's block or :data:`DISK` for each of the leading ``keys`` this instance's
        own tiers hold."""
        found: list[torch.Tensor | str] = []
        missed = {"host_miss_blocks": 0, "disk_miss_blocks": 0}
        for key in keys:
            block = self.host.get(key) if self.host is not None else None
            if block is not None:
                found.append(block)
                continue
            missed["host_miss_blocks"] += self.host is not None
            if self.disk is not None and self.disk.has(key):
                found.append(DISK)
                continue
            missed["disk_miss_blocks"] += self.disk is not None
            break
        with self._lock:
            for name, n in missed.items():
                self.counters[name] += n
        return found

    def _look_up_loop(self) -> None:
        assert self.shared is not None
        while True:
            job = self._lookups.get()
            if job is None:
                return
            req_id, keys = job
            try:
                self.shared.look_up(keys)  # what it finds is held() from now on
            except Exception:
                log.exception("shared KV tier lookup for %s failed; its prompt is computed", req_id)
            with self._lock:
                self._in_flight -= 1
                self._looked_up.append(req_id)
                self._done_event.set()
            try:
                self.waker()
            except Exception:
                log.exception("KV tier waker raised")

    def _block_of(self, page: int) -> torch.Tensor:
        view = self.pool.tensor[:, page]
        block = torch.empty(view.shape, dtype=view.dtype, device="cpu")
        block.copy_(view)
        return block

    def _hit_count(self, key: bytes) -> int:
        with self._lock:
            return self._hits.get(key, 0)

    def _admit(self, key: bytes, block: torch.Tensor) -> None:
        if self.disk is not None and self._hit_count(key) >= self.admit_hits:
            self.disk.put(key, block)

    def _load_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            req_id, loads = job
            start, ok = time.perf_counter(), 0
            try:
                ok = self._copy(loads)
            except Exception:
                log.exception("KV tier load for %s failed; its prompt is computed", req_id)
            with self._lock:
                self.load_seconds += time.perf_counter() - start
                if ok < len(loads):
                    self.counters["load_failures"] += 1
                self._in_flight -= 1
                self._done.append((req_id, ok))
                self._done_event.set()
            try:
                self.waker()
            except Exception:
                log.exception("KV tier waker raised")

    def _copy(self, loads: list[TierLoad]) -> int:
        """Copy ``loads`` into their pages in order, the disk tier's consecutive blocks read in
        batches; how many were copied before the first that could not be read."""
        i = 0
        while i < len(loads):
            start = time.perf_counter()
            if loads[i].on(DISK):
                assert self.disk is not None
                batch = loads[i : i + self.disk.batch_blocks]
                batch = batch[: next((n for n, b in enumerate(batch) if not b.on(DISK)), len(batch))]
                try:
                    for n, block in enumerate(self.disk.read_many([b.key for b in batch])):
                        if block is None:
                            return i + n
                        self.pool.tensor[:, batch[n].page].copy_(block)
                        with self._lock:
                            self.counters["disk_hit_blocks"] += 1
                finally:
                    self._took(DISK, start)
                i += len(batch)
                continue
            tier = SHARED if loads[i].on(SHARED) else HOST
            try:
                block = self._read(loads[i])
                if block is None:
                    return i
                self.pool.tensor[:, loads[i].page].copy_(block)
            finally:
                self._took(tier, start)
            i += 1
        return len(loads)

    def _took(self, tier: str, start: float) -> None:
        with self._lock:
            self.tier_seconds[tier] += time.perf_counter() - start

    def _read(self, load: TierLoad) -> torch.Tensor | None:
        """A host-tier or shared-tier block (the disk tier's are read in batches by :meth:`_copy`)."""
        if isinstance(load.block, torch.Tensor):
            with self._lock:
                self.counters["host_hit_blocks"] += 1
            return load.block
        assert self.shared is not None and load.on(SHARED)
        return self.shared.read(load.key)
