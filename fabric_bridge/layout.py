"""KV-cache layout description and the compatibility check between two engines.

A :class:`KVLayout` says how one engine instance stores its paged KV cache: the model, the
number of layers, tokens per page, total KV heads, how heads are sharded over tensor-parallel
ranks, head dim, dtype, the in-page order (``HND`` or ``NHD``) and the memory kind.

Per layer and per TP shard, a pool is one contiguous tensor:

* ``HND``: ``[num_pages, 2 (K,V), heads_per_shard, page_size, head_dim]``
* ``NHD``: ``[num_pages, page_size, 2 (K,V), heads_per_shard, head_dim]``

Sharding: with ``tp_size <= num_kv_heads`` shard ``s`` holds heads
``[s*hps, (s+1)*hps)`` (``hps = num_kv_heads // tp_size``). With more shards than heads the
cache is replicated: every shard holds one head, ``s * num_kv_heads // tp_size``.

:func:`check_compatible` refuses a pair that cannot exchange pages and names the mismatch.

Lock discipline: none needed; frozen values and pure functions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

_DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
_LAYOUTS = ("HND", "NHD")
_MEM_KINDS = ("DRAM", "VRAM")
# Fields that must be equal on both sides of a transfer.
_MUST_MATCH = ("model", "dtype", "page_size", "head_dim", "num_layers", "num_kv_heads")


class LayoutMismatch(ValueError):
    """Two KV layouts cannot exchange pages."""


@dataclass(frozen=True)
class KVLayout:
    """How one engine instance lays out its paged KV cache (see module docstring)."""

    model: str
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tp_size: int = 1
    layout: str = "HND"
    mem_kind: str = "DRAM"

    def __post_init__(self):
        if self.dtype not in _DTYPE_SIZES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; known: {sorted(_DTYPE_SIZES)}")
        if self.layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}, got {self.layout!r}")
        if self.mem_kind not in _MEM_KINDS:
            raise ValueError(f"mem_kind must be one of {_MEM_KINDS}, got {self.mem_kind!r}")
        for name in ("num_layers", "page_size", "num_kv_heads", "head_dim", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        heads, tp = self.num_kv_heads, self.tp_size
        if (tp <= heads and heads % tp) or (tp > heads and tp % heads):
            raise ValueError(f"{heads} KV heads cannot be sharded over TP {tp}: one must divide the other")

    @property
    def heads_per_shard(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def replicas(self) -> int:
        """How many shards hold each head (1 unless TP exceeds the KV head count)."""
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def itemsize(self) -> int:
        return _DTYPE_SIZES[self.dtype]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer of one shard (K and V)."""
        return 2 * self.heads_per_shard * self.page_size * self.head_dim * self.itemsize

    def shard_heads(self, shard: int) -> range:
        """Global KV head indices held by ``shard``."""
        if not 0 <= shard < self.tp_size:
            raise IndexError(f"shard {shard} out of range for TP {self.tp_size}")
        if self.replicas > 1:
            head = shard * self.num_kv_heads // self.tp_size
            return range(head, head + 1)
        hps = self.heads_per_shard
        return range(shard * hps, (shard + 1) * hps)

    def page_shape(self) -> tuple[int, ...]:
        """Shape of one page of one layer of one shard, in elements."""
        hps, ps, hd = self.heads_per_shard, self.page_size, self.head_dim
        return (2, hps, ps, hd) if self.layout == "HND" else (ps, 2, hps, hd)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


def check_compatible(src: KVLayout, dst: KVLayout) -> None:
    """Raise :class:`LayoutMismatch` naming every field that prevents src -> dst transfers.

    TP size, layout (HND/NHD) and memory kind may differ: the plan adapts to them.
    """
    bad = [
        f"{f}: {getattr(src, f)!r} vs {getattr(dst, f)!r}" for f in _MUST_MATCH if getattr(src, f) != getattr(dst, f)
    ]
    if bad:
        raise LayoutMismatch("incompatible KV layouts (local vs peer): " + "; ".join(bad))
