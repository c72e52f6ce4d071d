"""Block writer: one thread that writes the KV blocks handed to it (the disk tier's files, the
shared tier's store), so that no engine step waits for a write. Its queue is bounded: a block
that finds it full waits at most ``wait_s`` and is then dropped (the caller counts it)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

log = logging.getLogger("triton_disagg.engine")


class BlockWriter:
    def __init__(self, write: Callable[[bytes, torch.Tensor], None], name: str, capacity: int = 256):
        self._write = write
        self._queue: queue.Queue[tuple[bytes, torch.Tensor] | None] = queue.Queue(capacity)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def offer(self, key: bytes, block: torch.Tensor, wait_s: float = 0.0) -> bool:
        """Queue ``block`` (not modified afterwards); False: the queue stayed full (dropped)."""
        try:
            if wait_s > 0:
                self._queue.put((key, block), timeout=wait_s)
            else:
                self._queue.put_nowait((key, block))
            return True
        except queue.Full:
            return False

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued block is written; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued (at most ``timeout_s``), then stop the thread."""
        deadline = time.monotonic() + timeout_s
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:
                log.exception("%s: a block write failed", self._thread.name)
            finally:
                self._queue.task_done()
