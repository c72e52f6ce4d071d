"""Disk tier: KV blocks kept as files, below the host tier, across restarts.

The blocks (``kv_block.py``: one page's KV for every layer, named by its chained page hash) of
one salt and KV layout live in one folder (``<root>/<digest of salt and layout>/``), one file a
block: ``<hash hex>.kv``, in ``kv_block``'s form (a header with the layout digest, the hash and a
checksum, then the payload). A file is written whole under another name and renamed into place,
so a reader never sees half of one; a file the codec refuses (truncated, altered, another
layout's) is logged once, counted, removed and reported as a miss: its KV is computed again,
never loaded. Instances of the same model and layout on one
machine share the folder: a block another instance wrote is found by its name.

Writes go through one writer thread with a bounded queue (a full queue drops the block and counts
it); the folder is kept under ``capacity_bytes`` by removing the least recently used files this
instance knows (those it found at start, wrote, or read).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from backend.engine.block_writer import BlockWriter
from backend.engine.kv_block import BlockCodec, layout_digest

log = logging.getLogger("triton_disagg.engine")

WRITE_QUEUE = 256  # blocks waiting for the writer at most (a full queue drops)


class DiskTier:
    def __init__(self, root: Path, capacity_bytes: int, salt: bytes, layout: dict, block_shape: tuple, dtype):
        self.capacity_bytes = capacity_bytes
        self.codec = BlockCodec(layout_digest(salt, layout), block_shape, dtype)
        self.folder = Path(root) / self.codec.digest.hex()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.counters = {"writes": 0, "write_bytes": 0, "dropped": 0, "reads": 0, "read_bytes": 0, "corrupt": 0}
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, least recently used first
        self._bytes = 0
        self.version = 0  # changes whenever the set of blocks this instance knows does
        self._warned: set[str] = set()
        found = sorted(self.folder.glob("*.kv"), key=lambda p: p.stat().st_mtime_ns)
        for path in found:
            self._know(bytes.fromhex(path.stem), path.stat().st_size)
        self._trim()
        if found:
            log.info("disk KV tier: %d blocks (%d bytes) found in %s", len(self._index), self._bytes, self.folder)
        self._writer = BlockWriter(self._write_logged, "kv-disk-writer", WRITE_QUEUE)

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
        if not self._writer.offer(key, block, wait_s):
            with self._lock:
                self.counters["dropped"] += 1

    def read(self, key: bytes) -> torch.Tensor | None:
        """The block, or None: missing, or damaged (then logged once, counted and removed)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = bytearray(self.codec.size)  # read in place: the block's tensor uses it
                n = f.readinto(data)
                longer = bool(f.read(1))
        except OSError:
            self._forget(key)
            return None
        if n != len(data) or longer:
            self._damaged(key, path, f"{'more than ' if longer else ''}{n} bytes, expected {len(data)}")
            return None
        block, why = self.codec.decode(key, data)
        if block is None:
            self._damaged(key, path, why)
            return None
        with self._lock:
            self.counters["reads"] += 1
            self.counters["read_bytes"] += len(data)
            if key in self._index:
                self._index.move_to_end(key)
        return block

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def stats(self) -> dict:
        with self._lock:
            return {"blocks": len(self._index), "bytes": self._bytes, **self.counters}

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (at most ``timeout_s``), then stop the writer."""
        self._writer.close(timeout_s)

    # ---------------------------------------------------------------- internals
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
        self.version += 1
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
                self.version += 1

    def _trim(self) -> None:  # lock held
        while self._bytes > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            self.version += 1
            with contextlib.suppress(OSError):
                self.path(key).unlink()

    def _write_logged(self, key: bytes, block: torch.Tensor) -> None:
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
        header, payload = self.codec.encode_parts(key, block)
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
            self.counters["write_bytes"] += len(header) + len(payload)
            self._know(key, len(header) + len(payload))
            self._trim()
