"""The poster: runs a sender's posts in the order they were submitted, each once the device mark
it waits on is done, so the fabric never reads a page before the device has written it and the
engine thread never waits for the device or the network.

A post whose mark is done already and that has nothing queued before it runs at once in the
submitting thread (on the CPU every mark is done when made, so posting stays inline there);
any other post goes to the poster's thread. A mark that is not done within ``timeout_s``
(a hung device) calls ``on_error(req_id, reason)`` and the post then runs anyway (the caller
has stopped the request by then, so the post is refused and only its bookkeeping runs); the
request's later posts then run without waiting again. A post that raises calls ``on_error`` too.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from backend.engine.protocol import DeviceMark

log = logging.getLogger("triton_disagg.connector")


class Poster:
    def __init__(self, name: str, timeout_s: float, on_error: Callable[[str, str], None]):
        self.timeout_s, self._on_error = timeout_s, on_error
        self._queue: collections.deque[tuple[DeviceMark, str, Callable[[], object]]] = collections.deque()
        self._cv = threading.Condition()
        self._busy = False  # a post runs now (inline or on the thread)
        self._closing = False
        self._given_up: collections.OrderedDict[str, None] = collections.OrderedDict()  # requests stuck on the device
        self.deferred = 0  # posts that had to wait for the device (telemetry, tests)
        self._thread = threading.Thread(target=self._run, name=f"poster-{name}", daemon=True)
        self._thread.start()

    def submit(self, mark: DeviceMark, req_id: str, post: Callable[[], object]) -> None:
        with self._cv:
            if self._closing:
                return
            inline = not self._queue and not self._busy and mark.done()
            if not inline:
                self._queue.append((mark, req_id, post))
                self.deferred += 1
                self._cv.notify_all()
                return
            self._busy = True
        try:
            self._call(req_id, post)
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def pending(self) -> int:
        with self._cv:
            return len(self._queue) + self._busy

    def close(self) -> None:
        """Drop what is queued (the agent is closing) and stop the thread."""
        with self._cv:
            self._closing = True
            self._queue.clear()
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closing and (not self._queue or self._busy):
                    self._cv.wait()
                if self._closing:
                    return
                mark, req_id, post = self._queue.popleft()
                self._busy = True
            try:
                if req_id not in self._given_up and not mark.wait(self.timeout_s):
                    reason = f"the device did not finish writing the KV within {self.timeout_s}s"
                    log.error("request %s: %s", req_id, reason)
                    self._given_up[req_id] = None
                    while len(self._given_up) > 1024:
                        self._given_up.popitem(last=False)
                    self._fail(req_id, reason)
                self._call(req_id, post)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _call(self, req_id: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as exc:
            log.exception("posting for request %s failed", req_id)
            self._fail(req_id, f"posting failed: {type(exc).__name__}: {exc}")

    def _fail(self, req_id: str, reason: str) -> None:
        try:
            self._on_error(req_id, reason)
        except Exception:
            log.exception("error callback for request %s raised", req_id)
