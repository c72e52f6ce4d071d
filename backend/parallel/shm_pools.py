"""KV shard pools shared by a TP instance's main process and its rank processes.

The main process (rank 0) creates every rank's HND shard pool ``[layers, pages, 2,
heads_per_shard, page_size, head_dim]`` and keeps them all mapped, so the instance's single
fabric agent can register them as its TP shards and post every write; each rank process maps
only its own. On CPU a shard is a file in ``/dev/shm`` mapped with ``MAP_SHARED``
(``torch.from_file(shared=True)``); the files are unlinked once every rank has mapped them, so
nothing is left behind when processes die. On GPU a shard is allocated on the rank's device
by the main process and handed over as a CUDA IPC handle (``torch.multiprocessing``'s
reduction), the equivalent path; it is not exercised on this CPU-only machine.
"""

from __future__ import annotations

import math
import os
import tempfile
import uuid

import torch
from torch.multiprocessing.reductions import reduce_tensor


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class SharedShards:
    """Creates the shard pools of all ranks (in the main process) and the handles to open them."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, devices: list[torch.device]):
        self.paths: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.handles: list[tuple] = []
        numel = math.prod(shape)
        for rank, device in enumerate(devices):
            if device.type == "cuda":
                t = torch.zeros(shape, dtype=dtype, device=device)
                self.handles.append(("cuda_ipc", reduce_tensor(t)))
            else:
                path = os.path.join(_shm_dir(), f"triton_disagg_kv_{os.getpid()}_{uuid.uuid4().hex[:8]}_{rank}")
                with open(path, "wb") as f:
                    f.truncate(numel * torch.empty((), dtype=dtype).element_size())
                self.paths.append(path)
                t = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
                self.handles.append(("file", path, tuple(shape), dtype))
            self.tensors.append(t)

    def unlink(self) -> None:
        """Remove the backing files (mappings stay valid); call once every rank has mapped its shard."""
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.paths.clear()


def open_shard(handle: tuple) -> torch.Tensor:
    """Map one shard pool in a rank process from its handle."""
    if handle[0] == "cuda_ipc":
        rebuild, args = handle[1]
        return rebuild(*args)
    _, path, shape, dtype = handle
    return torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)
