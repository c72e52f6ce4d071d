"""Disk tier: KV blocks kept as files, below the host tier, across restarts.

The blocks (``kv_block.py``: one page's KV for every layer, named by its chained page hash) of
one salt and KV layout live in one folder (``<root>/<digest of salt and layout>/``), one file a
block: ``<hash hex>.kv``, in ``kv_block``'s form (a header with the layout digest, the hash and a
checksum, then the payload). A file is written whole under another name and renamed into place,
so a reader never sees half of one; a file the codec refuses (truncated, altered, another
layout's) is logged once, counted, removed and reported as a miss: its KV is computed again,
never loaded. Instances of the same model and layout on one
machine share the folder: a block another instance wrote is found by its name.

Reads come in batches (:meth:`DiskTier.read_many`, a request's consecutive blocks, at most
``batch_blocks``): the files are opened and their sizes checked, then read by the tier's
:class:`~backend.engine.file_reader.FileReader` (NIXL's POSIX backend where the serving layer
could start it, else plain ``pread``) into one staging buffer, where each block is checked and
used in place. A reader that fails is logged once and replaced by plain file I/O.

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
from backend.engine.file_reader import FileReader, PlainFileReader
from backend.engine.kv_block import HEADER, BlockCodec, layout_digest

log = logging.getLogger("triton_disagg.engine")

WRITE_QUEUE = 256  # blocks waiting for the writer at most (a full queue drops)
STAGE_BYTES = 32 << 20  # the read staging buffer (at least one block)


class DiskTier:
    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        salt: bytes,
        layout: dict,
        block_shape: tuple,
        dtype,
        reader: FileReader | None = None,
    ):
        self.capacity_bytes = capacity_bytes
        self.codec = BlockCodec(layout_digest(salt, layout), block_shape, dtype)
        self.reader: FileReader = reader if reader is not None else PlainFileReader()
        self.batch_blocks = max(1, STAGE_BYTES // self.codec.size)
        self._stage: torch.Tensor | None = None  # allocated at the first read
        self._read_lock = threading.RLock()  # the staging buffer and the reader
        self.folder = Path(root) / self.codec.digest.hex()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.counters = {
            "writes": 0,
            "write_bytes": 0,
            "dropped": 0,
            "reads": 0,
            "read_bytes": 0,
            "corrupt": 0,
            "read_errors": 0,
            "evicted": 0,  # files removed to stay under capacity_bytes
        }
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
        """The block (a tensor of its own), or None: missing, or damaged (then logged once, counted
        and removed)."""
        with self._read_lock:
            block = self.read_many([key])[0]
            return None if block is None else block.clone()

    def read_many(self, keys: list[bytes]) -> list[torch.Tensor | None]:
        """The blocks of ``keys`` (at most :attr:`batch_blocks`), each None where missing, damaged
        (logged once, counted, removed) or not read (a read error: logged once, counted, the file
        kept). The blocks are views of the tier's staging buffer, good until the next read: one
        caller at a time (the tiers' loader thread)."""
        if len(keys) > self.batch_blocks:
            raise ValueError(f"read_many: {len(keys)} blocks, at most {self.batch_blocks} at a time")
        with self._read_lock:
            return self._read_many(keys)

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def stats(self) -> dict:
        with self._lock:
            return {"blocks": len(self._index), "bytes": self._bytes, **self.counters}

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (at most ``timeout_s``), then stop the writer and the reader."""
        self._writer.close(timeout_s)
        with self._read_lock:
            self.reader.close()

    # ---------------------------------------------------------------- internals
    def _read_many(self, keys: list[bytes]) -> list[torch.Tensor | None]:
        size = self.codec.size
        out: list[torch.Tensor | None] = [None] * len(keys)
        fds: list[int] = []
        slots: list[int] = []  # which of keys each fd is
        try:
            for i, key in enumerate(keys):
                fd = self._open(key, size)
                if fd is not None:
                    fds.append(fd)
                    slots.append(i)
            if not fds or not self._read_files(fds, size):
                return out
        finally:
            for fd in fds:
                os.close(fd)
        assert self._stage is not None
        view = self._stage.numpy().data.cast("B")
        for j, i in enumerate(slots):
            key, at = keys[i], j * size
            why = self.codec.check(key, bytes(view[at : at + HEADER]), view[at + HEADER : at + size])
            if why:
                self._damaged(key, self.path(key), why)
                continue
            payload = self._stage[at + HEADER : at + size]
            out[i] = payload.view(self.codec.dtype).view(self.codec.block_shape)
            with self._lock:
                self.counters["reads"] += 1
                self.counters["read_bytes"] += size
                if key in self._index:
                    self._index.move_to_end(key)
        return out

    def _open(self, key: bytes, size: int) -> int | None:
        """The block's file opened for reading, or None: missing (forgotten) or of another size
        (damaged: logged, counted, removed)."""
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            self._forget(key)
            return None
        try:
            length = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            self._forget(key)
            return None
        if length != size:
            os.close(fd)
            self._damaged(key, path, f"of {length} bytes, expected {size}")
            return None
        return fd

    def _read_files(self, fds: list[int], size: int) -> bool:
        """Read the open files into the staging buffer; False (logged once, counted) when they
        cannot be read. A reader other than plain file I/O that fails is replaced by it."""
        if self._stage is None:
            self._stage = torch.empty(self.batch_blocks * size, dtype=torch.uint8)
        try:
            self.reader.read(fds, size, self._stage)
            return True
        except Exception as e:
            if isinstance(self.reader, PlainFileReader):
                self._warn_once("read", f"cannot read from {self.folder} ({e}); those blocks are computed")
                with self._lock:
                    self.counters["read_errors"] += 1
                return False
            with self._lock:
                self.counters["read_errors"] += 1
            failed, self.reader = self.reader, PlainFileReader()
            self._warn_once("reader", f"{failed.name} failed ({type(e).__name__}: {e}); reading with plain file I/O")
            with contextlib.suppress(Exception):
                failed.close()
            return self._read_files(fds, size)

    def _warn_once(self, what: str, message: str) -> None:
        with self._lock:
            first = what not in self._warned
            self._warned.add(what)
        if first:
            log.warning("disk KV tier: %s", message)

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
            self.counters["evicted"] += 1
            with contextlib.suppress(OSError):
                self.path(key).unlink()

    def _write_logged(self, key: bytes, block: torch.Tensor) -> None:
        try:
            self._write(key, block)
        except OSError as e:  # a full or read-only disk: logged once, the block dropped
            with self._lock:
                self.counters["dropped"] += 1
            self._warn_once("write", f"cannot write to {self.folder} ({e}); blocks are dropped")

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
