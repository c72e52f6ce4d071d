"""Transfer plan: which byte ranges of the source KV pages go to which destination ranges.

Pure Python + numpy, no NIXL. Given both sides' :class:`~fabric_bridge.layout.KVLayout`,
the request's source pages and destination pages, :func:`build_plan` returns a
:class:`TransferPlan`:

* For every destination shard and every source head group it needs, one source shard is
  chosen (at random among replicas when the source cache is replicated, ``rng`` seeded in
  tests). Each chosen (source shard, destination shard) pair shares a head range.
* For each pair, the in-page byte segments are computed once by walking the shared
  (K/V, head, token) rows in source memory order and merging rows that are contiguous on
  BOTH sides. So HND with matching heads gives one write per page (K and V adjacent),
  differing head slices give one write per K and per V, NHD with differing slices gives one
  write per token per K/V. The count is what a DMA engine would really have to do.
* Writes per layer = pages x segments; the receiver derives its expected count from
  :func:`expected_writes`, which depends only on the layouts and page counts, never on the
  replica choice, so both sides agree without talking.

Lock discipline: none needed; frozen values and pure functions.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .layout import KVLayout, check_compatible


@dataclass(frozen=True)
class PairSegments:
    """In-page byte segments moved from one source shard to one destination shard."""

    src_shard: int
    dst_shard: int
    src_off: np.ndarray  # int64 byte offsets inside a source page
    dst_off: np.ndarray  # int64 byte offsets inside a destination page
    length: np.ndarray  # int64 byte lengths

    def __len__(self) -> int:
        return len(self.length)


def _row_index(layout: KVLayout, kv: np.ndarray, head: np.ndarray, tok: np.ndarray) -> np.ndarray:
    """Row number (in units of head_dim elements) of (kv, shard-local head, token) in a page."""
    hps, ps = layout.heads_per_shard, layout.page_size
    if layout.layout == "HND":
        return (kv * hps + head) * ps + tok
    return (tok * 2 + kv) * hps + head


def page_segments(src: KVLayout, dst: KVLayout, src_shard: int, dst_shard: int) -> PairSegments | None:
    """Segments of one page for a shard pair, or None when the shards share no head."""
    s_heads, d_heads = src.shard_heads(src_shard), dst.shard_heads(dst_shard)
    lo, hi = max(s_heads.start, d_heads.start), min(s_heads.stop, d_heads.stop)
    if lo >= hi:
        return None
    kv, head, tok = np.meshgrid(np.arange(2), np.arange(lo, hi), np.arange(src.page_size), indexing="ij")
    kv, head, tok = kv.ravel(), head.ravel(), tok.ravel()
    s_rows = _row_index(src, kv, head - s_heads.start, tok)
    d_rows = _row_index(dst, kv, head - d_heads.start, tok)
    order = np.argsort(s_rows, kind="stable")
    s_rows, d_rows = s_rows[order], d_rows[order]
    breaks = (np.diff(s_rows) != 1) | (np.diff(d_rows) != 1)
    starts = np.concatenate(([0], np.nonzero(breaks)[0] + 1))
    n_rows = np.diff(np.concatenate((starts, [len(s_rows)])))
    row_bytes = src.head_dim * src.itemsize
    return PairSegments(
        src_shard,
        dst_shard,
        s_rows[starts].astype(np.int64) * row_bytes,
        d_rows[starts].astype(np.int64) * row_bytes,
        n_rows.astype(np.int64) * row_bytes,
    )


def _source_groups(src: KVLayout) -> list[list[int]]:
    """Source shards grouped by the head range they hold (replicas share a group)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for s in range(src.tp_size):
        r = src.shard_heads(s)
        groups.setdefault((r.start, r.stop), []).append(s)
    return list(groups.values())


def choose_pairs(src: KVLayout, dst: KVLayout, rng: random.Random | None = None) -> list[PairSegments]:
    """Pick, per destination shard, one source replica per head group; return their segments.

    ``rng=None`` picks the first replica (deterministic); pass a ``random.Random`` to spread
    load over replicas (and NICs) per request.
    """
    pairs = []
    groups = _source_groups(src)
    for d in range(dst.tp_size):
        for group in groups:
            s = rng.choice(group) if rng is not None else group[0]
            seg = page_segments(src, dst, s, d)
            if seg is not None:
                pairs.append(seg)
    return pairs


def all_pairs(src: KVLayout, dst: KVLayout) -> list[PairSegments]:
    """Segments of every (source shard, destination shard) pair any plan may use."""
    return [
        seg
        for d in range(dst.tp_size)
        for s in range(src.tp_size)
        if (seg := page_segments(src, dst, s, d)) is not None
    ]


def writes_per_page(src: KVLayout, dst: KVLayout) -> int:
    """Writes needed to move one page of one layer (all shards), independent of replica choice."""
    return sum(len(p) for p in choose_pairs(src, dst))


@dataclass(frozen=True)
class TransferPlan:
    """Writes for one request: page mapping plus the chosen shard pairs and their segments."""

    src: KVLayout
    dst: KVLayout
    src_pages: np.ndarray  # int64, position i of the request -> source page id
    dst_pages: np.ndarray  # int64, position i of the request -> destination page id
    pairs: tuple[PairSegments, ...]

    @property
    def n_pages(self) -> int:
        return len(self.src_pages)

    @property
    def writes_per_page(self) -> int:
        return sum(len(p) for p in self.pairs)

    def writes(self, positions: Sequence[int] | None = None, n_layers: int = 1) -> int:
        """Number of writes for ``positions`` (default: all pages) over ``n_layers`` layers."""
        n = self.n_pages if positions is None else len(positions)
        return n * self.writes_per_page * n_layers


def build_plan(
    src: KVLayout, dst: KVLayout, src_pages: Sequence[int], dst_pages: Sequence[int], rng: random.Random | None = None
) -> TransferPlan:
    """Plan moving ``src_pages[i]`` to ``dst_pages[i]`` for every layer. Raises on mismatch."""
    check_compatible(src, dst)
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"page count differs: {len(src_pages)} source vs {len(dst_pages)} destination")
    return TransferPlan(
        src,
        dst,
        np.asarray(src_pages, dtype=np.int64),
        np.asarray(dst_pages, dtype=np.int64),
        tuple(choose_pairs(src, dst, rng)),
    )


def expected_writes(
    src: KVLayout, dst: KVLayout, n_pages: int, n_layers: int | None = None, chunk_pages: Sequence[int] | None = None
) -> int:
    """KV writes the receiver must see for a request.

    ``n_pages``: pages of the request; ``n_layers``: layers sent (default all);
    ``chunk_pages``: pages posted by each prefill chunk when a page shared by two chunks is
    sent by both (default: each page once).
    """
    check_compatible(src, dst)
    layers = src.num_layers if n_layers is None else n_layers
    posted = n_pages if chunk_pages is None else sum(chunk_pages)
    return writes_per_page(src, dst) * posted * layers
