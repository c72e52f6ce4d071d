"""ProgressLoop: the agent's background thread that keeps transfers moving.

Each round it reaps finished xfers (:meth:`Sender.reap`), reads the notifications that arrived
(``get_new_notifs``; these NIXL calls also drive UCX progress, since NIXL's own progress thread
is off by default), decodes each into a :class:`~fabric_bridge.notifications.Notification` and
dispatches it -- writes/meta landed and sender stopped to the receiver's
:class:`~fabric_bridge.completion.CompletionTracker`, cancelled-by-receiver to the
:class:`~fabric_bridge.sender.Sender` -- then enforces receive deadlines and quarantines
(``tracker.tick()``) and tells the senders of requests that just timed out to stop. Malformed
notifications are logged and dropped; an exception in a round is logged and the loop goes on.

Lock discipline: the loop has no lock and holds none while calling NIXL (``get_new_notifs``)
or dispatching. The parts it calls take their own locks (the agent lock in the Sender, the
tracker's lock) and release them before returning; the tracker runs the receiver's callbacks
itself after releasing its lock, and the Sender's callbacks are collected in the round's
``fired`` list and run at the end of the round, with no lock held. Only this thread calls
:meth:`step`; :meth:`start` and :meth:`stop` are called by the agent's constructor and ``close``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .completion import CompletionTracker
from .notifications import Kind, MalformedNotification, Notification
from .sender import Fired, Sender, run_callbacks

log = logging.getLogger("triton_disagg.fabric")

# Poll gently: on a prefill instance this thread shares the cores (and the GIL) with the engine;
# polling at 5 kHz while writes were in flight cost ~8% of the prefill compute. Completions only
# free pages and count writes, so 1 ms is plenty. With nothing in flight the wait doubles from
# 2 ms up to 50 ms: at a steady 2 ms an idle instance's loop took 4-5% of a core (Zen 3, family 25
# model 1), for ever. The agent wakes the loop (:meth:`ProgressLoop.wake`) when work starts
# (a request expected, a write posted, a send finished or cancelled), so no transfer waits for it.
_POLL_BUSY_S, _POLL_IDLE_S, _POLL_IDLE_MAX_S = 0.001, 0.002, 0.05


class ProgressLoop:
    """The progress thread of one agent (see module docstring)."""

    def __init__(self, name: str, nixl: Any, sender: Sender, tracker: CompletionTracker):
        self._nixl, self._sender, self._tracker = nixl, sender, tracker
        self._closing, self._wake = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"fabric-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout=timeout)

    def wake(self) -> None:
        """Run a round now (work has started: the loop may be in a long idle wait). A busy loop
        polls every 1 ms without looking at it, so the posts that follow each other add no round."""
        self._wake.set()

    def _loop(self) -> None:
        idle_s = _POLL_IDLE_S
        while not self._closing.is_set():
            fired: Fired = []
            busy = False
            try:
                busy = self.step(fired)
            except Exception:
                log.exception("fabric progress loop error")
            run_callbacks(fired)
            if busy:
                idle_s = _POLL_IDLE_S
                time.sleep(_POLL_BUSY_S)
                continue
            if self._wake.wait(idle_s):  # set since the round began: work started, no wait
                self._wake.clear()
            else:
                idle_s = min(2 * idle_s, _POLL_IDLE_MAX_S)

    def step(self, fired: Fired) -> bool:
        """One round (see module docstring); True while there is work in flight."""
        self._sender.reap(fired)
        notifs = self._nixl.get_new_notifs()
        busy = bool(self._sender.busy() or notifs or self._tracker.expecting() or self._tracker.quarantined())
        for peer, msgs in notifs.items():
            peer = peer.decode() if isinstance(peer, bytes) else peer
            for data in msgs:
                self._dispatch(peer, data, fired)
        for req_id, to, generation in self._tracker.tick():
            if to is not None:
                self._sender.notify(to, Kind.CANCELLED_BY_RECEIVER, req_id, generation)
        return busy

    def _dispatch(self, peer: str, data: bytes, fired: Fired) -> None:
        try:
            n = Notification.decode(data)
        except MalformedNotification as e:
            log.warning("ignoring malformed notification %r from %s: %s", data, peer, e)
            return
        if n.kind is Kind.WRITES_LANDED:
            self._tracker.writes_landed(n.req_id, n.generation, n.count)
        elif n.kind is Kind.META_LANDED:
            self._tracker.meta_landed(n.req_id, n.generation, n.count)
        elif n.kind is Kind.SENDER_STOPPED:
            self._tracker.sender_stopped(n.req_id, n.generation)
        elif n.kind is Kind.CANCELLED_BY_RECEIVER:
            self._sender.on_cancelled_by_receiver(peer, n.req_id, n.generation, fired)
