"""Unit tests of the receiver's completion tracker: counters, generations, meta slots,
timeouts and quarantine (no NIXL; time is passed in explicitly)."""

import threading
import time

import pytest
import torch

from fabric_bridge.completion import CompletionTracker


def tracker(slots=2, quarantine_s=5.0):
    return CompletionTracker(torch.zeros(slots, 8), quarantine_s)


def test_count_and_meta_complete_once():
    t, calls = tracker(), []
    h = t.expect("a", 6, on_done=lambda *a: calls.append(a), with_meta=True)
    t.writes_landed("a", h.generation, 4)
    t._meta[h.slot, :3] = torch.tensor([1.0, 2.0, 3.0])
    t.meta_landed("a", h.generation, 3)
    assert not h.done.is_set() and t.counts("a") == (4, 6)
    t.writes_landed("a", h.generation, 2)
    assert h.wait(0) and calls[0][:3] == ("a", True, None)
    assert calls[0][3].tolist() == [1.0, 2.0, 3.0]
    t.writes_landed("a", h.generation, 2)  # after completion: ignored, no second callback
    assert len(calls) == 1 and t.pending() == 0


def test_stale_generation_is_ignored():
    t = tracker()
    old = t.expect("r", 2)
    t.cancel("r")
    new = t.expect("r", 2)
    assert new.generation != old.generation
    t.writes_landed("r", old.generation, 2)  # late notification of the cancelled request
    assert t.counts("r") == (0, 2) and not new.done.is_set()
    t.writes_landed("r", new.generation, 2)
    assert new.wait(0)


def test_timeout_quarantines_slot_until_sender_confirms():
    t, released = tracker(slots=1), []
    h = t.expect("r", 3, timeout_s=1.0, with_meta=True, peer="p", on_release=lambda *a: released.append(a))
    now = time.monotonic()
    assert t.tick(now) == []
    assert t.tick(now + 2) == [("r", "p", h.generation)]
    assert h.done.is_set() and not h.ok and "timeout (transfer): 0/3 writes, meta no" in h.error
    with pytest.raises(RuntimeError, match="no free meta slot"):
        t.expect("other", 1, with_meta=True)  # the slot is quarantined, not reusable yet
    t.sender_stopped("r", h.generation)
    assert released == [("r", h.generation)]
    assert t.expect("other", 1, with_meta=True).slot == h.slot


def test_quarantine_expires_without_confirmation():
    t, released = tracker(quarantine_s=5.0), []
    h = t.expect("r", 3, on_release=lambda *a: released.append(a))
    assert t.cancel("r") == (None, h.generation)
    assert h.error == "cancelled" and t.cancel("r") is None
    now = time.monotonic()
    t.tick(now + 4)
    assert released == []
    t.tick(now + 6)
    assert released == [("r", h.generation)] and t.pending() == 0


def test_sender_stop_fails_active_request_and_releases_at_once():
    t, released = tracker(), []
    h = t.expect("r", 3, on_release=lambda *a: released.append(a))
    t.sender_stopped("r", h.generation)
    assert not h.ok and h.error == "sender stopped" and released == [("r", h.generation)]


def test_rearm_moves_the_deadline_and_names_what_timed_out():
    t = tracker()
    h = t.expect("r", 3, timeout_s=1.0)
    now = time.monotonic()
    assert t.rearm("r", h.generation, 10.0, "prefill and transfer")
    assert t.tick(now + 2) == []  # the first deadline no longer applies
    assert not t.rearm("r", h.generation + 1, 10.0, "x")  # another generation: ignored
    assert t.tick(now + 11) == [("r", None, h.generation)]
    assert "timeout (prefill and transfer): 0/3 writes" in h.error
    assert not t.rearm("r", h.generation, 10.0, "x")  # no longer active


def test_a_deadline_renewed_on_writes_bounds_the_time_without_progress():
    t = tracker()
    h = t.expect("r", 3, timeout_s=1.0)
    assert t.rearm("r", h.generation, 0.3, "prefill and transfer", renew_on_writes=True)
    for _ in range(2):  # writes keep landing: the request outlives its first deadline
        time.sleep(0.2)
        t.writes_landed("r", h.generation, 1)
    assert t.tick(time.monotonic() + 0.1) == [] and t.counts("r") == (2, 3)
    assert t.tick(time.monotonic() + 0.5) == [("r", None, h.generation)]  # then no write for longer
    assert "timeout (prefill and transfer): 2/3 writes" in h.error


def test_a_release_never_overtakes_the_failure_it_follows():
    """cancel() runs on_done(failure) on its thread while the sender's stop arrives on another:
    on_release waits until on_done has run, so the owner always hears of the failure first."""

    order, in_done, go_on = [], threading.Event(), threading.Event()

    def on_done(req_id, ok, err, meta):
        in_done.set()
        go_on.wait(5)
        order.append(("done", ok))

    t = CompletionTracker(None, quarantine_s=60)
    h = t.expect("r", 4, on_done=on_done, peer="p", on_release=lambda rid, gen: order.append(("released", rid)))
    canceller = threading.Thread(target=t.cancel, args=("r", "client went away"))
    canceller.start()
    assert in_done.wait(5)
    t.sender_stopped("r", h.generation)  # the progress thread, while on_done still runs
    assert order == []
    go_on.set()
    canceller.join(5)
    assert order == [("done", False), ("released", "r")] and t.pending() == 0
