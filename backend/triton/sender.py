"""A Triton decoupled response sender that is safe to poll from other threads.

Triton frees a request's response factory once the final response is sent; calling
``is_cancelled()`` on it after that (or at the same moment, from a watcher thread) crashes
the server. This wrapper serialises ``send`` and ``is_cancelled`` and never touches the
sender again after the final response: ``is_cancelled()`` then answers False.
"""
from __future__ import annotations

import threading


class GuardedSender:
    def __init__(self, pb_utils, sender):
        self._pb = pb_utils
        self._sender = sender
        self._lock = threading.Lock()
        self.closed = False

    def send(self, response=None, flags: int = 0) -> None:
        final = bool(flags & self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        with self._lock:
            if self.closed:
                raise RuntimeError("the final response was already sent")
            if final:
                self.closed = True
            if response is None:
                self._sender.send(flags=flags)
            else:
                self._sender.send(response, flags=flags)

    def is_cancelled(self) -> bool:
        with self._lock:
            return not self.closed and self._sender.is_cancelled()
