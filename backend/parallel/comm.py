"""Communication inside one tensor-parallel engine instance.

Two channels: a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU) built directly
on a ``TCPStore`` that rank 0 hosts (no global default group, so several instances can live
in one process, as in tests) carries the per-layer all-reduces; and each worker rank's stdin
pipe carries the step messages from rank 0 (length-prefixed pickles between our own
processes). Workers wait for work on the pipe, which has no timeout and reads EOF when rank 0
goes away; collectives run only inside a step, under the group's timeout.
"""

from __future__ import annotations

import datetime
import pickle
import struct

import torch
import torch.distributed as dist

_LEN = struct.Struct("<Q")


def host_store(world: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (``store.port``)."""
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)


def join_group(
    store: dist.Store | None, port: int, rank: int, world: int, device: torch.device, prefix: str, timeout_s: float
):
    """Build the instance's process group (blocks until every rank joined or ``timeout_s``)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    store = dist.PrefixStore(prefix, store)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def all_reduce(group, tensor: torch.Tensor) -> None:
    """Sum ``tensor`` over the group's ranks, in place."""
    group.allreduce([tensor]).wait()


def write_step_message(stream, obj) -> None:
    """A pipe frame to a rank process (8-byte length + pickle; both ends are our own processes,
    parent to child, so pickle carries the batch and CUDA IPC handles as they are). The KV
    messenger between instances uses ``fabric_bridge.control``'s JSON framing instead."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def read_step_message(stream):
    """The next message, or None at end of stream (rank 0 is gone)."""
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)
