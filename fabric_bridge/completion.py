"""CompletionTracker: the receiving side of a FabricAgent (the decode instance's role).

Per-request write counters, generations, timeouts, meta-buffer slots and page quarantine. No
NIXL here: the agent's progress thread feeds it the notifications that arrived.

Life of a request on the receiver:

1. :meth:`CompletionTracker.expect` gives the request a fresh *generation* (unique per
   tracker) and, if asked, a meta slot. The (req_id, generation) pair goes to the sender.
2. Every notification ``(req_id, generation, n)`` adds ``n`` landed writes; notifications with
   any other generation are stale and ignored. When the count reaches the expected number
   (and the meta block arrived, if one is expected) ``on_done(req_id, True, None, meta)``
   fires once and the slot is freed (``meta`` is a copy). Counting assumes NIXL delivers each
   xfer's notification once (it does); a notification after completion is ignored.
3. Timeout or :meth:`cancel`: ``on_done(req_id, False, reason, None)`` fires and the request is
   *quarantined*: writes the sender had in flight may still land in its pages and slot. Only
   when the sender confirms it stopped (:meth:`sender_stopped`) or ``quarantine_s`` passes is
   the slot reused and ``on_release(req_id, generation)`` called: only then may the caller
   give the destination pages to another request.

Lock discipline -- the *tracker lock* (``self._lock``, a plain Lock, never re-entered):

* It guards the active and quarantined entries, the free meta slots and the generation counter.
* Threads that call in: the engine's threads (``expect``, ``rearm``, ``cancel``, ``counts``), the
  agent's progress thread (``writes_landed``, ``meta_landed``, ``sender_stopped``, ``tick``) and
  the Sender, for meta staging slots (``acquire_slot``, ``release_slot``), which may hold the
  agent lock meanwhile: this lock is the innermost, nothing is called out of it.
* Callbacks (``on_done``, ``on_release``) always run after the lock is released, on the thread
  whose call decided the outcome; a handle's ``done`` is set before its ``on_done`` runs, and a
  failed request's ``on_release`` never runs before its ``on_done``: a sender's stop that arrives
  on the progress thread while another thread is still running ``on_done`` is held back
  (``stop_seen``) and released by that thread right after.
* ``expecting()`` reads the active table without the lock (a hint for the poll rate).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger("triton_disagg.fabric")

DoneCallback = Callable[[str, bool, str | None, torch.Tensor | None], None]
ReleaseCallback = Callable[[str, int], None]


@dataclass
class RecvHandle:
    """A request the receiver expects. ``req_id``, ``generation`` and ``slot`` go to the
    sender; ``done`` is set (after ``ok``/``error``/``meta``) when the request completes or fails."""

    req_id: str
    generation: int
    slot: int | None
    expected: int
    done: threading.Event = field(default_factory=threading.Event, repr=False)
    ok: bool | None = None
    error: str | None = None
    meta: torch.Tensor | None = field(default=None, repr=False)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done; return ``ok`` (False on timeout of this wait)."""
        return bool(self.done.wait(timeout) and self.ok)


@dataclass
class _Entry:
    handle: RecvHandle
    peer: str | None
    deadline: float
    with_meta: bool
    on_done: DoneCallback | None
    on_release: ReleaseCallback | None
    landed: int = 0
    meta_floats: int | None = None
    release_at: float = field(default=float("inf"))
    meta_out: torch.Tensor | None = None
    waiting_for: str = "transfer"  # what the deadline bounds, named in the timeout message
    renew_s: float | None = None  # set: each landed write moves the deadline this far ahead
    failing: bool = False  # quarantined, its on_done(failure) not yet run: on_release must wait
    stop_seen: bool = False  # the sender's stop arrived meanwhile: release once on_done has run


class CompletionTracker:
    """Counts landed writes per (req_id, generation); owns the meta slots (see module doc)."""

    def __init__(self, meta: torch.Tensor | None, quarantine_s: float = 5.0):
        self._meta = meta
        self._free_slots = list(range(meta.shape[0])) if meta is not None else []
        self._quarantine_s = quarantine_s
        self._active: dict[str, _Entry] = {}
        self._quarantined: dict[tuple[str, int], _Entry] = {}
        self._next_gen = 1
        self._lock = threading.Lock()

    # -- called by the owner of the request --------------------------------------------------
    def expect(
        self,
        req_id: str,
        expected_writes: int,
        on_done: DoneCallback | None = None,
        timeout_s: float = 30.0,
        with_meta: bool = False,
        peer: str | None = None,
        on_release: ReleaseCallback | None = None,
        waiting_for: str = "transfer",
    ) -> RecvHandle:
        with self._lock:
            if req_id in self._active:
                raise ValueError(f"request {req_id!r} is already expected")
            slot = self._take_slot() if with_meta else None
            handle = RecvHandle(req_id, self._next_gen, slot, expected_writes)
            self._next_gen += 1
            self._active[req_id] = _Entry(
                handle, peer, time.monotonic() + timeout_s, with_meta, on_done, on_release, waiting_for=waiting_for
            )
            return handle

    def rearm(
        self, req_id: str, generation: int, timeout_s: float, waiting_for: str, renew_on_writes: bool = False
    ) -> bool:
        """Move an active request's deadline to ``timeout_s`` from now (e.g. when its sender
        reports that it started); with ``renew_on_writes`` every landed write moves it again, so
        the deadline bounds the time without progress, not the whole transfer. False if the
        request is not active under ``generation`` any more."""
        with self._lock:
            entry = self._current(req_id, generation)
            if entry is None:
                return False
            entry.deadline = time.monotonic() + timeout_s
            entry.waiting_for = waiting_for
            entry.renew_s = timeout_s if renew_on_writes else None
            return True

    def cancel(self, req_id: str, reason: str = "cancelled") -> tuple[str | None, int] | None:
        """Fail an active request; return ``(peer, generation)`` to tell the sender, or None."""
        with self._lock:
            entry = self._active.pop(req_id, None)
            if entry is None:
                return None
            self._quarantine(entry)
        self._fire(entry, False, reason, None)
        self._after_failure(entry)
        return entry.peer, entry.handle.generation

    def acquire_slot(self) -> int:
        """Take a free meta slot for other use (the sender stages its meta block in one)."""
        with self._lock:
            return self._take_slot()

    def release_slot(self, slot: int) -> None:
        with self._lock:
            self._free_slots.append(slot)

    def counts(self, req_id: str) -> tuple[int, int] | None:
        """``(landed, expected)`` of an active request."""
        with self._lock:
            e = self._active.get(req_id)
            return None if e is None else (e.landed, e.handle.expected)

    # -- called by the agent's progress thread -----------------------------------------------
    def writes_landed(self, req_id: str, generation: int, n: int) -> None:
        with self._lock:
            entry = self._current(req_id, generation)
            if entry is None:
                return
            entry.landed += n
            if entry.renew_s is not None:
                entry.deadline = time.monotonic() + entry.renew_s
            done = self._take_if_done(entry)
        if done:
            self._fire(done, True, None, done.meta_out)

    def meta_landed(self, req_id: str, generation: int, n_floats: int) -> None:
        with self._lock:
            entry = self._current(req_id, generation)
            if entry is None:
                return
            entry.meta_floats = n_floats
            done = self._take_if_done(entry)
        if done:
            self._fire(done, True, None, done.meta_out)

    def sender_stopped(self, req_id: str, generation: int, reason: str = "sender stopped") -> None:
        """The sender has no write in flight for (req_id, generation) and will post no more."""
        with self._lock:
            entry = self._active.get(req_id)
            failed = entry if entry is not None and entry.handle.generation == generation else None
            if failed is not None:
                del self._active[req_id]
                self._quarantine(failed)
            released = self._quarantined.get((req_id, generation))
            if released is not None and released.failing and released is not failed:
                released.stop_seen = True  # another thread runs its on_done now: it releases after
                released = None
            elif released is not None:
                del self._quarantined[(req_id, generation)]
                self._free_slot(released)
        if failed is not None:
            self._fire(failed, False, reason, None)
            failed.failing = False
        if released is not None:
            self._release(released)

    def tick(self, now: float | None = None) -> list[tuple[str, str | None, int]]:
        """Time out overdue requests and end expired quarantines.

        Returns ``(req_id, peer, generation)`` of requests that just timed out, so the agent
        can tell their senders to stop.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            late = [e for e in self._active.values() if e.deadline <= now]
            for e in late:
                del self._active[e.handle.req_id]
                self._quarantine(e, now)
            expired = [k for k, e in self._quarantined.items() if e.release_at <= now and not e.failing]
            released = [self._quarantined.pop(k) for k in expired]
            for e in released:
                self._free_slot(e)
        for e in late:
            meta = "" if not e.with_meta else f", meta {'yes' if e.meta_floats is not None else 'no'}"
            self._fire(e, False, f"timeout ({e.waiting_for}): {e.landed}/{e.handle.expected} writes{meta}", None)
            self._after_failure(e)
        for e in released:
            log.warning(
                "request %s gen %d: quarantine ended without sender confirmation", e.handle.req_id, e.handle.generation
            )
            self._release(e)
        return [(e.handle.req_id, e.peer, e.handle.generation) for e in late]

    def expecting(self) -> bool:
        """True while some request waits for writes (the agent then polls faster)."""
        return bool(self._active)

    def quarantined(self) -> bool:
        """True while some failed request's pages wait for its sender's stop (polled faster too)."""
        return bool(self._quarantined)

    def pending(self) -> int:
        with self._lock:
            return len(self._active) + len(self._quarantined)

    # -- internals ----------------------------------------------------------------------------
    def _current(self, req_id: str, generation: int) -> _Entry | None:
        entry = self._active.get(req_id)
        if entry is None or entry.handle.generation != generation:
            log.debug("ignoring stale notification for %s gen %d", req_id, generation)
            return None
        return entry

    def _take_if_done(self, entry: _Entry) -> _Entry | None:
        if entry.landed < entry.handle.expected or (entry.with_meta and entry.meta_floats is None):
            return None
        if entry.landed > entry.handle.expected:
            log.warning(
                "request %s: %d writes landed, expected %d", entry.handle.req_id, entry.landed, entry.handle.expected
            )
        del self._active[entry.handle.req_id]
        if entry.with_meta:  # copy before the slot can be handed out again
            assert self._meta is not None  # a slot was taken: there is a meta buffer
            entry.meta_out = self._meta[entry.handle.slot, : entry.meta_floats].clone()
        self._free_slot(entry)
        return entry

    def _take_slot(self) -> int:
        if not self._free_slots:
            raise RuntimeError("no free meta slot (all in use or quarantined)")
        return self._free_slots.pop(0)

    def _quarantine(self, entry: _Entry, now: float | None = None) -> None:
        """Lock held; the caller fires on_done(failure) next, then calls :meth:`_after_failure`."""
        entry.release_at = (time.monotonic() if now is None else now) + self._quarantine_s
        entry.failing = True
        self._quarantined[(entry.handle.req_id, entry.handle.generation)] = entry

    def _after_failure(self, entry: _Entry) -> None:
        """on_done(failure) has run: on_release may now fire, at once if the sender's stop
        arrived meanwhile (so a caller always hears of the failure before the release)."""
        with self._lock:
            entry.failing = False
            key = (entry.handle.req_id, entry.handle.generation)
            released = self._quarantined.pop(key, None) if entry.stop_seen else None
            if released is not None:
                self._free_slot(released)
        if released is not None:
            self._release(released)

    def _free_slot(self, entry: _Entry) -> None:
        if entry.handle.slot is not None:
            self._free_slots.append(entry.handle.slot)

    @staticmethod
    def _fire(entry: _Entry, ok: bool, err: str | None, meta: torch.Tensor | None) -> None:
        h = entry.handle
        h.ok, h.error, h.meta = ok, err, meta
        h.done.set()
        if entry.on_done is None:
            return
        try:
            entry.on_done(entry.handle.req_id, ok, err, meta)
        except Exception:
            log.exception("on_done callback for %s raised", entry.handle.req_id)

    @staticmethod
    def _release(entry: _Entry) -> None:
        if entry.on_release is None:
            return
        try:
            entry.on_release(entry.handle.req_id, entry.handle.generation)
        except Exception:
            log.exception("on_release callback for %s raised", entry.handle.req_id)
