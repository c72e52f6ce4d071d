"""Paged KV cache pool in HND layout.

One contiguous tensor ``[num_layers, num_pages, 2 (K, V), num_kv_heads, page_size, head_dim]``:
``pool[l]`` is one layer's contiguous pool, and one page of one layer (K and V, all heads) is one
contiguous byte range, so the transfer engine can register the whole tensor once and move a page
of a layer with a single write.
"""

from __future__ import annotations

import torch


class KVPool:
    """Owns the KV tensor; knows nothing about which request holds which page."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        num_kv_heads: int,
        page_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        tensor: torch.Tensor | None = None,
    ):
        """``tensor``: an existing zeroed tensor of the pool's shape to use (e.g. shared memory)."""
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.num_kv_heads = num_kv_heads
        self.page_size = page_size
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_pages, 2, num_kv_heads, page_size, head_dim)
        if tensor is not None and (tuple(tensor.shape) != shape or tensor.dtype != dtype):
            raise ValueError(f"KV pool tensor is {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}")
        self.tensor = torch.zeros(shape, dtype=dtype, device=self.device) if tensor is None else tensor

    def layer(self, layer_idx: int) -> torch.Tensor:
        """View ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` of one layer (contiguous)."""
        return self.tensor[layer_idx]

    @property
    def bytes_per_page_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.page_size * self.head_dim * self.tensor.element_size()

    @property
    def bytes_per_layer(self) -> int:
        return self.num_pages * self.bytes_per_page_per_layer

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.bytes_per_layer

    def layout(self) -> dict:
        """What a peer needs to check that its pages are byte-compatible with ours."""
        return {
            "layout": "HND",
            "num_layers": self.num_layers,
            "num_pages": self.num_pages,
            "page_size": self.page_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "bytes_per_page_per_layer": self.bytes_per_page_per_layer,
        }
