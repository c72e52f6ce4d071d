"""Peer: what an agent prepared, once, for writing to one connected agent.

``FabricAgent.add_peer`` builds a :class:`Peer` from the peer's handshake payload: two prepped
NIXL descriptor lists, local and remote, holding every in-page segment of every page of every
layer of every shard (rows ``(addr, len, dev)``, see :func:`dlist_rows`), plus the remote meta
slots. A post then only computes indices into those lists (``sender.py``).

Segments are numbered per shard (:func:`seg_tables`); the row of (shard s, layer, page, seg) is
``start[s] + (layer * n_pages[s] + page) * n_segments[s] + seg`` on either side.

Lock discipline: no lock here. These are pure functions and a record; the agent's peer
table that holds the records, and the NIXL lists inside them, are guarded by the agent lock
(``agent.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .layout import KVLayout
from .nixl_api import Releasable
from .plan import PairSegments

SegTable = dict[tuple[int, int], int]  # (offset in page, length) -> segment id, in id order
PairIds = dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]  # (src, dst shard) -> segment ids


@dataclass
class Peer:
    """Prepped descriptor lists for writing to one peer (see module docstring)."""

    name: str
    layout: KVLayout
    n_pages: list[int]  # pages per shard of the peer
    local_dl: Releasable
    remote_dl: Releasable
    local_start: list[int]  # first row of each local shard in ``local_dl``
    remote_start: list[int]  # first row of each remote shard in ``remote_dl``
    local_nseg: list[int]  # segments per page of each local shard
    remote_nseg: list[int]
    pair_ids: PairIds
    meta_dl: Releasable | None  # one row per remote meta slot, None without meta slots

    def release(self) -> None:
        for dl in (self.local_dl, self.remote_dl, self.meta_dl):
            if dl is not None:
                dl.release()


def seg_tables(pairs: Sequence[PairSegments], n_src: int, n_dst: int) -> tuple[list[SegTable], list[SegTable], PairIds]:
    """Per-shard segment ids: {(offset, length): id} for the source and destination sides,
    and per shard pair the (source ids, destination ids) of its segments."""
    src_t: list[SegTable] = [{} for _ in range(n_src)]
    dst_t: list[SegTable] = [{} for _ in range(n_dst)]
    pair_ids: PairIds = {}
    for p in pairs:
        sid = [
            src_t[p.src_shard].setdefault((int(o), int(n)), len(src_t[p.src_shard]))
            for o, n in zip(p.src_off, p.length)
        ]
        did = [
            dst_t[p.dst_shard].setdefault((int(o), int(n)), len(dst_t[p.dst_shard]))
            for o, n in zip(p.dst_off, p.length)
        ]
        pair_ids[(p.src_shard, p.dst_shard)] = (np.array(sid, dtype=np.int64), np.array(did, dtype=np.int64))
    return src_t, dst_t, pair_ids


def dlist_rows(
    bases: Sequence[Sequence[int]],
    n_pages: Sequence[int],
    page_bytes: int,
    tables: Sequence[SegTable],
    devs: Sequence[int],
) -> tuple[np.ndarray, list[int]]:
    """Descriptor rows ``(addr, len, dev)`` for every shard/layer/page/segment (``bases``: per
    shard, the address of each layer's pool), and the row where each shard starts."""
    rows, starts, n = [], [], 0
    for s, table in enumerate(tables):
        starts.append(n)
        if not table:
            continue
        segs = np.array(list(table), dtype=np.uint64)  # insertion order == segment id
        addr = (
            np.array(bases[s], dtype=np.uint64)[:, None, None]
            + (np.arange(n_pages[s], dtype=np.uint64) * np.uint64(page_bytes))[None, :, None]
            + segs[None, None, :, 0]
        )
        block = np.empty((addr.size, 3), dtype=np.uint64)
        block[:, 0] = addr.ravel()
        block[:, 1] = np.broadcast_to(segs[:, 1], addr.shape).ravel()
        block[:, 2] = devs[s]
        rows.append(block)
        n += len(block)
    return np.concatenate(rows), starts


def meta_rows(addr: int, slots: int, floats: int, dev: int) -> np.ndarray:
    """Descriptor rows of a meta buffer: one per slot of ``floats`` fp32 values."""
    rows = np.empty((slots, 3), dtype=np.uint64)
    rows[:, 0] = addr + np.arange(slots, dtype=np.uint64) * np.uint64(floats * 4)
    rows[:, 1] = floats * 4
    rows[:, 2] = dev
    return rows
