"""KV block: one page's KV for every layer (``[num_layers, 2, kv_heads, page_size, head_dim]``)
as bytes, the form the disk and shared tiers keep it in.

A block is named by its chained page hash (``page_allocator.page_hashes``: the tokens up to the
page's end, salted with the model's identity, the weights and KV formats, the TP layout, the page
size and the request's ``cache_salt``). Its bytes: a header (magic, the digest of the salt and KV
layout it was written under, the hash, the payload's length and its SHA-256 checksum: hardware
SHA on the x86 CPUs this runs on, several times BLAKE2b's speed here) and the payload.
:meth:`BlockCodec.decode` refuses, with the reason, bytes that are short, damaged, of another
block, or written for another model identity or KV layout: such a block is computed again, never
loaded.
"""

from __future__ import annotations

import hashlib
import json

import torch

MAGIC = b"TDKV1\n"
HEADER = len(MAGIC) + 16 + 16 + 8 + 32  # magic, layout digest, hash, payload length, checksum


def _checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.sha256(payload).digest()


def layout_digest(salt: bytes, layout: dict) -> bytes:
    """What names the blocks of one page-hash salt and KV layout (16 bytes)."""
    return hashlib.blake2b(salt + json.dumps(layout, sort_keys=True).encode(), digest_size=16).digest()


class BlockCodec:
    def __init__(self, digest: bytes, block_shape: tuple, dtype: torch.dtype):
        self.digest = digest
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.block_bytes = int(torch.empty(self.block_shape, dtype=dtype).nbytes)

    def encode_parts(self, key: bytes, block: torch.Tensor) -> tuple[bytes, memoryview]:
        """The header and the payload (a view of ``block``'s bytes, no copy)."""
        payload = block.contiguous().view(torch.uint8).numpy().data.cast("B")
        return MAGIC + self.digest + key + len(payload).to_bytes(8, "little") + _checksum(payload), payload

    def encode(self, key: bytes, block: torch.Tensor) -> bytes:
        return b"".join(self.encode_parts(key, block))

    @property
    def size(self) -> int:
        """A block's bytes, header included."""
        return HEADER + self.block_bytes

    def decode(self, key: bytes, data: bytes | bytearray) -> tuple[torch.Tensor | None, str]:
        """(the block, "") or (None, why it is refused). A ``bytearray`` is used in place (its
        payload becomes the tensor's memory); ``bytes`` are copied."""
        why = self._check(key, data)
        if why:
            return None, why
        buffer = data if isinstance(data, bytearray) else bytearray(data)
        return torch.frombuffer(buffer, dtype=self.dtype, offset=HEADER).view(self.block_shape), ""

    def _check(self, key: bytes, data: bytes | bytearray) -> str:
        if len(data) < HEADER or not data.startswith(MAGIC):
            return "not a KV block (short, or no magic)"
        at = len(MAGIC)
        digest, stored_key = data[at : at + 16], data[at + 16 : at + 32]
        length = int.from_bytes(data[at + 32 : at + 40], "little")
        checksum = data[at + 40 : HEADER]
        if digest != self.digest:
            return "written for another model identity or KV layout"
        if stored_key != key:
            return "holds another block than its name says"
        if length != self.block_bytes or len(data) != HEADER + length:
            return f"payload of {len(data) - HEADER} bytes, expected {self.block_bytes}"
        if _checksum(memoryview(data)[HEADER:]) != checksum:
            return "checksum mismatch"
        return ""
