"""The poster: posts run in submission order, each after its device mark; inline when nothing
waits; a mark that never completes or a post that raises fails only its request."""

from __future__ import annotations

import threading
import time

from backend.disagg.poster import Poster
from backend.engine.device_progress import DONE, DeviceProgress


class Mark:
    def __init__(self):
        self.event = threading.Event()

    def done(self):
        return self.event.is_set()

    def wait(self, timeout_s=None):
        return self.event.wait(timeout_s)


def test_cpu_marks_are_done_and_post_inline():
    assert DeviceProgress().mark() is DONE and DONE.done() and DONE.wait(0)
    poster, ran = Poster("t", 5.0, lambda r, e: None), []
    try:
        poster.submit(DONE, "a", lambda: ran.append(threading.current_thread().name))
        assert ran == [threading.current_thread().name] and poster.deferred == 0
    finally:
        poster.close()


def test_posts_wait_for_their_marks_in_order():
    errors, ran = [], []
    poster = Poster("t", 5.0, lambda r, e: errors.append((r, e)))
    try:
        first, second = Mark(), Mark()
        poster.submit(first, "a", lambda: ran.append("a1"))
        poster.submit(second, "b", lambda: ran.append("b1"))
        poster.submit(DONE, "a", lambda: ran.append("a2"))  # done, but behind the others
        time.sleep(0.1)
        assert ran == [] and poster.pending() == 3
        second.event.set()
        time.sleep(0.1)
        assert ran == []  # the first post still waits, and the order holds
        first.event.set()
        deadline = time.monotonic() + 5
        while poster.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran == ["a1", "b1", "a2"] and poster.deferred == 3 and not errors
    finally:
        poster.close()


def test_stuck_mark_and_raising_post_fail_their_request_only():
    errors, ran = [], []
    poster = Poster("t", 0.2, lambda r, e: errors.append((r, e)))
    try:
        poster.submit(Mark(), "stuck", lambda: ran.append("stuck1"))  # never done
        poster.submit(Mark(), "stuck", lambda: ran.append("stuck2"))  # same request: no second wait
        poster.submit(DONE, "boom", lambda: 1 / 0)
        poster.submit(DONE, "fine", lambda: ran.append("fine"))
        deadline = time.monotonic() + 5
        while poster.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran == ["stuck1", "stuck2", "fine"]
        assert [r for r, _ in errors] == ["stuck", "boom"]
        assert "did not finish writing the KV within 0.2s" in errors[0][1]
        assert "ZeroDivisionError" in errors[1][1]
    finally:
        poster.close()
