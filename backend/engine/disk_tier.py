"""Disk tier: KV blocks kept as files, below the host tier, across restarts.

A block is one page's KV for every layer (``[num_layers, 2, kv_heads, page_size, head_dim]``), named
by its chained page hash (``page_allocator.page_hashes``: the tokens up to the page's end, salted
with the model's identity, the weights and KV formats, the TP layout and the page size). The
blocks of one salt and KV layout live in one folder (``<root>/<digest of salt and layout>/``), one
file a block: ``<hash hex>.kv``, a header (magic, the folder's digest, the hash, the payload's
length and BLAKE2b checksum) and the payload. A file is written whole under another name and
renamed into place, so a reader never sees half of one; a file whose header or checksum does not
match (truncated, altered, another layout's) is logged once, counted, removed and reported as a
miss: its KV is computed again, never loaded. Instances of the same model and layout on one
machine share the folder: a block another instance wrote is found by its name.

Writes go through one writer thread with a bounded queue (a full queue drops the block and counts
it); the folder is kept under ``capacity_bytes`` by removing the least recently used files this
instance knows (those it found at start, wrote, or read).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

log = logging.getLogger("triton_disagg.engine")

MAGIC = b"TDKV1\n"
WRITE_QUEUE = 256  # blocks waiting for the writer at most (a full queue drops)
HEADER = len(MAGIC) + 16 + 16 + 8 + 32  # magic, folder digest, hash, payload length, checksum


def _checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


class DiskTier:
    def __init__(self, root: Path, capacity_bytes: int, salt: bytes, layout: dict, block_shape: tuple, dtype):
        self.capacity_bytes = capacity_bytes
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.digest = hashlib.blake2b(salt + json.dumps(layout, sort_keys=True).encode(), digest_size=16).digest()
        self.folder = Path(root) / self.digest.hex()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.block_bytes = int(torch.empty(self.block_shape, dtype=dtype).nbytes)
        self.counters = {"writes": 0, "write_bytes": 0, "dropped": 0, "reads": 0, "read_bytes": 0, "corrupt": 0}
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, least recently used first
        self._bytes = 0
        self._warned: set[str] = set()
        found = sorted(self.folder.glob("*.kv"), key=lambda p: p.stat().st_mtime_ns)
        for path in found:
            self._know(bytes.fromhex(path.stem), path.stat().st_size)
        self._trim()
        if found:
            log.info("disk KV tier: %d blocks (%d bytes) found in %s", len(self._index), self._bytes, self.folder)
        self._queue: queue.Queue[tuple[bytes, torch.Tensor] | None] = queue.Queue(WRITE_QUEUE)
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    def path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}.kv"

    def has(self, key: bytes) -> bool:
        """The block is in the tier (this instance's index, or a file another instance wrote)."""
        with self._lock:
            if key in self._index:
                return True
        try:
            size = self.path(key).stat().st_size
        except OSError:
            return False
        with self._lock:
            self._know(key, size)
        return True

    def put(self, key: bytes, block: torch.Tensor, wait_s: float = 0.0) -> None:
        """Queue ``block`` (a CPU tensor of the block's shape, not modified afterwards) for writing;
        when the queue is full, wait at most ``wait_s``, then drop it (counted)."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return
        try:
            self._queue.put((key, block), timeout=wait_s) if wait_s > 0 else self._queue.put_nowait((key, block))
        except queue.Full:
            with self._lock:
                self.counters["dropped"] += 1

    def read(self, key: bytes) -> torch.Tensor | None:
        """The block, or None: missing, or damaged (then logged once, counted and removed)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            self._forget(key)
            return None
        why = self._check(key, data)
        if why is not None:
            self._damaged(key, path, why)
            return None
        payload = bytearray(memoryview(data)[HEADER:])
        with self._lock:
            self.counters["reads"] += 1
            self.counters["read_bytes"] += len(payload)
            if key in self._index:
                self._index.move_to_end(key)
        return torch.frombuffer(payload, dtype=self.dtype).view(self.block_shape)

    def stats(self) -> dict:
        with self._lock:
            return {"blocks": len(self._index), "bytes": self._bytes, **self.counters}

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (at most ``timeout_s``), then stop the writer."""
        deadline = time.monotonic() + timeout_s
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._writer.join(max(0.0, deadline - time.monotonic()))

    # ---------------------------------------------------------------- internals
    def _check(self, key: bytes, data: bytes) -> str | None:
        if len(data) < HEADER or not data.startswith(MAGIC):
            return "not a KV block file (short, or no magic)"
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
        return None

    def _damaged(self, key: bytes, path: Path, why: str) -> None:
        with self._lock:
            self.counters["corrupt"] += 1
            first = why not in self._warned
            self._warned.add(why)
        if first:
            log.warning("disk KV tier: %s %s; removed, its KV is computed again", path.name, why)
        with contextlib.suppress(OSError):
            path.unlink()
        self._forget(key)

    def _know(self, key: bytes, size: int) -> None:  # lock held
        if key in self._index:
            self._bytes -= self._index[key]
        self._index[key] = size
        self._index.move_to_end(key)
        self._bytes += size

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    def _trim(self) -> None:  # lock held
        while self._bytes > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            with contextlib.suppress(OSError):
                self.path(key).unlink()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, block = item
            try:
                self._write(key, block)
            except OSError as e:  # a full or read-only disk: logged once, the block dropped
                with self._lock:
                    self.counters["dropped"] += 1
                    first = "write" not in self._warned
                    self._warned.add("write")
                if first:
                    log.warning("disk KV tier: cannot write to %s (%s); blocks are dropped", self.folder, e)

    def _write(self, key: bytes, block: torch.Tensor) -> None:
        payload = block.contiguous().view(torch.uint8).numpy().tobytes()
        header = MAGIC + self.digest + key + len(payload).to_bytes(8, "little") + _checksum(payload)
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, self.path(key))
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with self._lock:
            self.counters["writes"] += 1
            self.counters["write_bytes"] += len(payload)
            self._know(key, len(header) + len(payload))
            self._trim()
