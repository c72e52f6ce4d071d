"""Host tier: KV blocks evicted from the pool, kept in host memory, bounded, least recently used out.

A block is one page's KV for every layer, a CPU tensor ``[num_layers, 2, kv_heads, page_size,
head_dim]``, named by its chained page hash (see ``disk_tier.py``). Blocks are allocated as they
come (an idle tier costs nothing) and never modified: a load in flight keeps its tensor even if the
tier lets the block go meanwhile.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


class HostTier:
    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.version = 0  # changes whenever the set of blocks does

    def put(self, key: bytes, block: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
        """Keep ``block``; returns the blocks this pushed out (least recently used first)."""
        with self._lock:
            self.version += 1
            self._blocks[key] = block
            self._blocks.move_to_end(key)
            out = []
            while len(self._blocks) > self.capacity_blocks:
                out.append(self._blocks.popitem(last=False))
            return out

    def get(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
            return block

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._blocks

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._blocks)

    def items(self) -> list[tuple[bytes, torch.Tensor]]:
        with self._lock:
            return list(self._blocks.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)
