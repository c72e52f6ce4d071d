"""NixlFileReader: the disk KV tier's files read through NIXL's POSIX file backend, the transfer
engine that also moves KV between instances (one agent of its own, no network, no progress thread).

A read is one NIXL transfer: the files are registered as ``FILE`` memory (``(0, size, fd)``), the
staging buffer as ``DRAM`` (once, kept while it stays the same buffer), and one ``READ`` of every
file into its slot is posted and polled until ``DONE`` (a short sleep between polls: the backend's
own threads do the I/O); whatever fails raises OSError, and the disk tier
(``backend/engine/disk_tier.py``) then logs it once and reads with plain file I/O. ``mode`` picks
the backend's I/O queue: ``posix_aio`` (POSIX AIO, the default: the fastest from a cold page cache
here, ``perf/bench_disk_tier.py``), ``uring`` (io_uring, which a container's seccomp may refuse)
or ``aio`` (Linux AIO).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Any

import torch

from fabric_bridge import nixl_api

MODES = {"posix_aio": "use_posix_aio", "uring": "use_uring", "aio": "use_aio"}
POLL_S = 0.0002
_names = itertools.count()


class NixlFileReader:
    def __init__(self, mode: str = "posix_aio", timeout_s: float = 10.0):
        """Start an agent with the POSIX backend in ``mode``; raises (ImportError, ValueError or
        NIXL's error) when it cannot."""
        if mode not in MODES:
            raise ValueError(f"NixlFileReader: mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.name = f"NIXL POSIX ({mode})"
        self.timeout_s = timeout_s
        api = nixl_api.load()
        self._agent: Any = api.nixl_agent(
            f"kv-disk-{os.getpid()}-{next(_names)}", api.nixl_agent_config(enable_prog_thread=False, backends=[])
        )
        self._agent.create_backend("POSIX", {MODES[mode]: "true"})
        self._lock = threading.Lock()
        self._buffer: tuple[int, int] | None = None  # (address, bytes) of the registered staging buffer
        self._buffer_reg: Any = None

    def read(self, fds: list[int], size: int, into: torch.Tensor) -> None:
        try:
            self._read(fds, size, into)
        except OSError:
            raise
        except Exception as e:  # NIXL's own errors (nixlBackendError ...): an OSError, as the interface says
            raise OSError(f"NIXL POSIX read of {len(fds)} file(s) failed: {type(e).__name__}: {e}") from e

    def _read(self, fds: list[int], size: int, into: torch.Tensor) -> None:
        with self._lock:
            agent = self._agent
            if agent is None:
                raise OSError("NixlFileReader is closed")
            self._register(into)
            files = agent.register_memory([(0, size, fd, "") for fd in fds], "FILE", backends=["POSIX"])
            try:
                handle = agent.initialize_xfer(
                    "READ",
                    agent.get_xfer_descs([(into.data_ptr() + i * size, size, 0) for i in range(len(fds))], "DRAM"),
                    agent.get_xfer_descs([(0, size, fd) for fd in fds], "FILE"),
                    agent.name,
                    backends=["POSIX"],
                )
                try:
                    self._wait(handle, len(fds) * size)
                finally:
                    agent.release_xfer_handle(handle)
            finally:
                agent.deregister_memory(files, backends=["POSIX"])

    def close(self) -> None:
        with self._lock:
            agent, self._agent = self._agent, None
            if agent is not None and self._buffer_reg is not None:
                agent.deregister_memory(self._buffer_reg, backends=["POSIX"])
            self._buffer_reg = self._buffer = None

    def _register(self, into: torch.Tensor) -> None:
        buffer = (into.data_ptr(), into.numel() * into.element_size())
        if self._buffer != buffer:
            if self._buffer_reg is not None:
                self._agent.deregister_memory(self._buffer_reg, backends=["POSIX"])
                self._buffer_reg = self._buffer = None
            self._buffer_reg = self._agent.register_memory(into, backends=["POSIX"])
            self._buffer = buffer

    def _wait(self, handle: Any, nbytes: int) -> None:
        state = self._agent.transfer(handle)
        deadline = time.monotonic() + self.timeout_s
        while state == "PROC":
            if time.monotonic() > deadline:
                raise TimeoutError(f"NIXL POSIX read of {nbytes} bytes not done after {self.timeout_s:.0f} s")
            time.sleep(POLL_S)
            state = self._agent.check_xfer_state(handle)
        if state != "DONE":
            raise OSError(f"NIXL POSIX read of {nbytes} bytes ended in state {state!r}")
