"""How far the device has got: the marks a KV connector waits on before it lets the fabric read
what a layer (or a step) wrote.

On CUDA, kernels run after Python has queued them: when the per-layer hook fires, the layer's
KV write is queued, not done. :meth:`DeviceProgress.mark` queues, on the current stream, an
increment of a device counter and a copy of the counter into pinned host memory, and returns a
:class:`CounterMark` that is done once the host copy shows that increment, i.e. once the
device has executed everything queued before the mark. Neither queued operation blocks the
host, and both are an ordinary kernel and an ordinary device-to-host copy, so a CUDA graph can
capture them (a replayed graph advances the counter as a live run would; whoever replays a
captured step must also call :meth:`CudaProgress.advance` for the marks inside it; no step is
graph-captured today). On the CPU operations run when they are called: every mark is done at
once.
"""

from __future__ import annotations

import threading
import time

import torch


class DoneMark:
    """A mark that is done already (CPU, or nothing queued)."""

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float | None = None) -> bool:
        return True


DONE = DoneMark()


class DeviceProgress:
    """CPU: marks are done when made."""

    def mark(self):
        return DONE


class CudaProgress(DeviceProgress):
    """A device counter advanced in stream order, mirrored into pinned host memory."""

    def __init__(self, device: torch.device):
        self.device = device
        self._counter = torch.zeros(1, dtype=torch.int64, device=device)
        self._host = torch.zeros(1, dtype=torch.int64).pin_memory()
        self._view = self._host.numpy()  # reads the pinned memory without a CUDA call
        self._issued = 0
        self._lock = threading.Lock()

    def mark(self) -> CounterMark:
        with self._lock:  # marks from two threads on one stream: issue order == target order
            self._counter.add_(1)
            self._host.copy_(self._counter, non_blocking=True)
            self._issued += 1
            return CounterMark(self, self._issued)

    def advance(self, n: int) -> int:
        """A replayed CUDA graph holding ``n`` marks: the host's count of marks issued moves on;
        returns the target of the last one."""
        with self._lock:
            self._issued += n
            return self._issued

    def reached(self) -> int:
        return int(self._view[0])


class CounterMark:
    """Done once the device counter has reached ``target``."""

    __slots__ = ("progress", "target")

    def __init__(self, progress: CudaProgress, target: int):
        self.progress, self.target = progress, target

    def done(self) -> bool:
        return self.progress.reached() >= self.target

    def wait(self, timeout_s: float | None = None) -> bool:
        """Poll (sleeping 20 us, backing off to 0.5 ms) until done; False after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pause = 20e-6
        while not self.done():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 5e-4)
        return True


def make_progress(device: torch.device) -> DeviceProgress:
    return CudaProgress(device) if device.type == "cuda" else DeviceProgress()
