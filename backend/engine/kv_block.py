"""KV block: one page's KV for every layer (``[num_layers, 2, kv_heads, page_size, head_dim]``)
as bytes, the form the disk and shared tiers keep it in.

A block is named by its chained page hash (``page_allocator.page_hashes``: the tokens up to the
page's end, salted with the model's identity, the weights and KV formats, the TP layout, the page
size and the request's ``cache_salt``). Its bytes: a header (magic, the digest of the salt and KV
layout it was written under, the hash, the payload's length and its XXH3-128 checksum: 0.11 ms a
737,280-byte block here against SHA-256's 0.41, hardware SHA on this Zen 4; the checksum finds
damage, the digest and the hash in the header keep blocks of other models and layouts out) and
the payload, from byte 64 (aligned: the disk tier uses a block where it read it).
:meth:`BlockCodec.check` judges a block in place (its header and a view of its payload), so the
disk tier verifies what it read into its staging buffer without a copy.
:meth:`BlockCodec.decode` refuses, with the reason, bytes that are short, damaged, of another
block, or written for another model identity or KV layout: such a block is computed again, never
loaded.
"""

from __future__ import annotations

import hashlib
import json

import torch
import xxhash

MAGIC = b"TDKV2\n\0\0"  # TDKV1: SHA-256 and a 78-byte header (such files are refused as "not a KV block")
HEADER = len(MAGIC) + 16 + 16 + 8 + 16  # magic, layout digest, hash, payload length, checksum: 64


def _checksum(payload: bytes | bytearray | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(payload)


def layout_digest(salt: bytes, layout: dict) -> bytes:
    """What names the blocks of one page-hash salt, KV layout and block format (16 bytes): the disk
    tier's folder and the shared tier's key prefix, so blocks of a format before are never found."""
    return hashlib.blake2b(MAGIC + salt + json.dumps(layout, sort_keys=True).encode(), digest_size=16).digest()


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
        view = memoryview(data)
        why = self.check(key, bytes(view[:HEADER]), view[HEADER:])
        if why:
            return None, why
        buffer = data if isinstance(data, bytearray) else bytearray(data)
        return torch.frombuffer(buffer, dtype=self.dtype, offset=HEADER).view(self.block_shape), ""

    def check(self, key: bytes, header: bytes, payload: memoryview) -> str:
        """Why a block of ``header`` and ``payload`` (read or received under the name ``key``) is
        refused, or "" when it is sound."""
        if len(header) < HEADER or not header.startswith(MAGIC):
            return "not a KV block (short, or no magic)"
        at = len(MAGIC)
        digest, stored_key = header[at : at + 16], header[at + 16 : at + 32]
        length = int.from_bytes(header[at + 32 : at + 40], "little")
        checksum = header[at + 40 : HEADER]
        if digest != self.digest:
            return "written for another model identity or KV layout"
        if stored_key != key:
            return "holds another block than its name says"
        if length != self.block_bytes or len(payload) != length:
            return f"payload of {len(payload)} bytes, expected {self.block_bytes}"
        if _checksum(payload) != checksum:
            return "checksum mismatch"
        return ""
