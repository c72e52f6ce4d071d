"""File reader: how the disk tier (``disk_tier.py``) reads a batch of block files into its staging
buffer. The engine defines the interface and a plain POSIX one (``pread`` per file); NIXL's POSIX
file backend is another (``fabric_bridge/file_reader.py``, built by the serving layer, which knows
NIXL: the engine does not import it).
"""

from __future__ import annotations

import os
from typing import Protocol

import torch


class FileReader(Protocol):
    """Reads whole files into host memory."""

    name: str  # for logs and figures

    def read(self, fds: list[int], size: int, into: torch.Tensor) -> None:
        """Read the first ``size`` bytes of each open file ``fds[i]`` into ``into[i * size : (i + 1)
        * size]`` (``into``: a contiguous uint8 CPU tensor, the same one call after call). The files
        are known to be ``size`` bytes long. Raises OSError (or the transport's error) when a read
        fails or comes back short."""

    def close(self) -> None: ...


class PlainFileReader:
    """One ``preadv`` per file, on the calling thread."""

    name = "plain file I/O"

    def read(self, fds: list[int], size: int, into: torch.Tensor) -> None:
        view = into.numpy().data.cast("B")
        for i, fd in enumerate(fds):
            n = os.preadv(fd, [view[i * size : (i + 1) * size]], 0)
            if n != size:
                raise OSError(f"read {n} of {size} bytes")

    def close(self) -> None:
        pass
