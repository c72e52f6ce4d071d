"""Sender: the sending side of a FabricAgent (the prefill instance's role).

It posts KV xfers (:meth:`Sender.post_layer`, one per request, chunk and layer) and the meta
block (:meth:`Sender.post_meta`), keeps each request's send state (generation, xfers in flight,
first error, stopping) and the xfers in flight, reaps them for the progress thread
(:meth:`Sender.reap`: DONE, ERR, peer gone, stuck past ``xfer_timeout_s``), and retires a
request once nothing of it is in flight: ``finish_send``'s callback fires exactly once, and a
stopped request sends ``SENDER_STOPPED`` so the receiver may reuse its pages. Every standalone
notification this agent sends, either side's, goes out through :meth:`Sender.notify`.

A post only computes indices into the peer's prepped descriptor lists (``peers.py``); the
indices of a (plan, positions) are computed for every layer at once and kept in a small cache,
so the other layers of the step take a row of them without locking.

Lock discipline -- the *agent lock* (an RLock the agent creates and shares with this class):

* It guards the send state (``_sends``, ``_stopped``, ``_inflight``), writes to the index cache,
  ``stats``, and the agent's peer table with the NIXL lists in it (``agent.py``).
* A post checks that its request is not stopping, calls ``make_prepped_xfer`` + ``transfer``
  and records the xfer in flight in one hold of the lock, and a request is retired under it
  too: so no write of a request can be posted after its ``SENDER_STOPPED``. ``send_notif`` and
  the release of xfer handles also run under it.
* Not under it: ``check_xfer_state`` (:meth:`reap` polls a snapshot of the xfers in flight,
  then retires the finished ones under the lock), an index-cache hit (one dict read), and
  every callback. Work that reaches user code (``on_send_error``, ``finish_send``'s callback,
  sending ``SENDER_STOPPED``) is appended to a ``fired`` list while the lock is held and run by
  :func:`run_callbacks` after it is released.
* Threads that call in: the engine's posting threads (``post_*``, ``finish_send``, ``cancel``),
  the progress thread (:meth:`reap`, :meth:`on_cancelled_by_receiver`, :meth:`notify`), the
  handshake thread (``add_peer``) and ``close``.
* Order: the CompletionTracker's lock (meta staging slots) may be taken while the agent lock
  is held, never the other way round.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .completion import CompletionTracker
from .layout import KVLayout
from .nixl_api import Releasable
from .notifications import Kind, pack
from .peers import Peer
from .plan import TransferPlan

log = logging.getLogger("triton_disagg.fabric")

SendCallback = Callable[[str, bool, str | None], None]
ErrorCallback = Callable[[str, int, str], None]
Fired = list[Callable[[], None]]  # callbacks collected under a lock, run after it is released
Indices = tuple[np.ndarray, np.ndarray]  # local and remote descriptor indices, [layers, descriptors]

_REMEMBER_STOPPED = 4096  # stopped (req_id -> generation) kept to drop late posts
_INDEX_CACHE = 64  # (plan, positions) whose descriptor indices are kept for the next layers' posts


def run_callbacks(fired: Fired) -> None:
    """Run callbacks collected under a lock (never call this with a lock held)."""
    for f in fired:
        try:
            f()
        except Exception:
            log.exception("fabric callback raised")


@dataclass
class _Send:
    peer: str
    generation: int
    inflight: int = 0
    error: str | None = None
    stopping: bool = False
    on_done: SendCallback | None = None


@dataclass
class _Xfer:
    handle: Releasable
    req_id: str
    send: _Send
    posted_at: float
    stage_slot: int | None = None


class Sender:
    """The sending side of one agent (see module docstring)."""

    def __init__(
        self,
        nixl: Any,
        lock: threading.RLock,
        peers: dict[str, Peer],
        layout: KVLayout,
        n_pages: list[int],
        tracker: CompletionTracker,
        meta: torch.Tensor | None,
        meta_local_dl: Releasable | None,
        xfer_timeout_s: float,
        on_send_error: ErrorCallback | None,
    ):
        self._nixl, self._lock, self._peers = nixl, lock, peers
        self._layout, self._n_pages = layout, n_pages
        self._tracker, self._meta, self._meta_local_dl = tracker, meta, meta_local_dl
        self._xfer_timeout_s, self._on_send_error = xfer_timeout_s, on_send_error
        self._sends: dict[str, _Send] = {}
        self._stopped: OrderedDict[str, tuple[int, str]] = OrderedDict()  # req_id -> (generation, why)
        self._inflight: list[_Xfer] = []
        self._index_cache: OrderedDict[tuple, tuple[TransferPlan, Indices | None]] = OrderedDict()
        # Posting telemetry: time in make_prepped_xfer and in transfer() (where a transport
        # that copies synchronously, like UCX's cma, does its work), xfers and writes posted.
        self.stats: dict[str, float] = {"make_xfer_s": 0.0, "transfer_call_s": 0.0, "xfers": 0, "writes": 0}

    # ---------------------------------------------------------------- posting (engine threads)
    def post_layer(
        self,
        peer: str,
        req_id: str,
        generation: int,
        plan: TransferPlan,
        layer: int,
        positions: Sequence[int] | None = None,
    ) -> bool:
        p = self._peers[peer]
        if not 0 <= layer < self._layout.num_layers:
            raise IndexError(f"layer {layer} out of range")
        idx = self._step_indices(p, plan, positions)
        if idx is None:
            return True
        li, ri = idx[0][layer], idx[1][layer]
        msg = pack(Kind.WRITES_LANDED, generation, len(li), req_id)
        return self._post(p, req_id, generation, p.local_dl, li, p.remote_dl, ri, msg, None)

    def _step_indices(self, p: Peer, plan: TransferPlan, positions: Sequence[int] | None) -> Indices | None:
        """Descriptor indices of the plan's pages at ``positions``, local and remote, for every
        layer at once (two ``[layers, descriptors]`` arrays), or None for no pages. The layers of
        one step post the same positions, so the last few results are kept: a layer's post then
        takes its row of each (the plan's layouts are checked once, when its indices are made)."""
        key = (id(plan), p.name, None if positions is None else tuple(positions))
        hit = self._index_cache.get(key)  # one dict read, atomic: no lock taken on a hit
        if hit is not None and hit[0] is plan:
            return hit[1]
        if plan.src != self._layout or plan.dst != p.layout:
            raise ValueError("plan was built for other layouts than this agent and peer")
        sel = slice(None) if positions is None else np.asarray(positions, dtype=np.int64)
        sp, dp = plan.src_pages[sel], plan.dst_pages[sel]
        if len(sp) == 0:
            return None
        layers = np.arange(self._layout.num_layers, dtype=np.int64)[:, None]
        local, remote = [], []  # per shard pair: [layers, descriptors]
        for pair in plan.pairs:
            s, d = pair.src_shard, pair.dst_shard
            lid, rid = p.pair_ids[(s, d)]
            if sp.max() >= self._n_pages[s] or dp.max() >= p.n_pages[d] or min(sp.min(), dp.min()) < 0:
                raise IndexError(
                    f"page id out of range (source shard {s}: {self._n_pages[s]} pages, "
                    f"destination shard {d}: {p.n_pages[d]} pages)"
                )
            first_local = (p.local_start[s] + sp[:, None] * p.local_nseg[s] + lid[None, :]).ravel()
            first_remote = (p.remote_start[d] + dp[:, None] * p.remote_nseg[d] + rid[None, :]).ravel()
            local.append(first_local[None, :] + layers * (self._n_pages[s] * p.local_nseg[s]))
            remote.append(first_remote[None, :] + layers * (p.n_pages[d] * p.remote_nseg[d]))
        out = (np.concatenate(local, axis=1).astype(np.int32), np.concatenate(remote, axis=1).astype(np.int32))
        with self._lock:
            self._index_cache[key] = (plan, out)
            while len(self._index_cache) > _INDEX_CACHE:
                self._index_cache.popitem(last=False)
        return out

    def post_meta(
        self, peer: str, req_id: str, generation: int, slot: int, hidden: torch.Tensor, logits: torch.Tensor
    ) -> bool:
        p = self._peers[peer]
        if p.meta_dl is None or self._meta is None or self._meta_local_dl is None:
            raise ValueError("meta write needs meta slots on both agents")
        flat = torch.cat([hidden.reshape(-1), logits.reshape(-1)]).to(torch.float32)
        if flat.numel() > self._meta.shape[1]:
            raise ValueError(f"meta block of {flat.numel()} floats exceeds the slot size {self._meta.shape[1]}")
        stage = self._tracker.acquire_slot()
        self._meta[stage, : flat.numel()].copy_(flat)
        if self._meta.is_cuda:  # the copy is queued on this thread's stream: NIXL must read it done
            staged = torch.cuda.Event()
            staged.record()
            staged.synchronize()
        msg = pack(Kind.META_LANDED, generation, flat.numel(), req_id)
        ok = self._post(
            p,
            req_id,
            generation,
            self._meta_local_dl,
            np.array([stage], dtype=np.int32),
            p.meta_dl,
            np.array([slot], dtype=np.int32),
            msg,
            stage,
        )
        if not ok:
            self._tracker.release_slot(stage)
        return ok

    def _post(
        self,
        p: Peer,
        req_id: str,
        generation: int,
        local_dl: Releasable,
        li: np.ndarray,
        remote_dl: Releasable,
        ri: np.ndarray,
        msg: bytes,
        stage: int | None,
    ) -> bool:
        fired: Fired = []
        posted = False
        with self._lock:
            st = self._sends.get(req_id)
            if st is None or st.generation != generation:
                old = self._stopped.get(req_id)
                if old is not None and old[0] == generation:
                    return False
                st = self._sends[req_id] = _Send(p.name, generation)
            if st.stopping:
                return False
            h = None
            try:
                t0 = time.perf_counter()
                h = self._nixl.make_prepped_xfer("WRITE", local_dl, li, remote_dl, ri, msg)
                t1 = time.perf_counter()
                state = self._nixl.transfer(h)
                self.stats["make_xfer_s"] += t1 - t0
                self.stats["transfer_call_s"] += time.perf_counter() - t1
                self.stats["xfers"] += 1
                self.stats["writes"] += len(li)
            except Exception as e:
                if h is not None:  # made but not posted: nothing in flight, free the handle now
                    self._release_unposted(h)
                self._fail(req_id, st, f"posting to {p.name} failed: {type(e).__name__}: {e}", fired)
            else:
                self._inflight.append(_Xfer(h, req_id, st, time.monotonic(), stage))
                st.inflight += 1
                posted = state != "ERR"
                if not posted:
                    self._fail(req_id, st, f"transfer to {p.name} failed at post (ERR)", fired)
        run_callbacks(fired)
        return posted

    def finish_send(self, req_id: str, on_done: SendCallback) -> None:
        fired: Fired = []
        with self._lock:
            st = self._sends.get(req_id)
            if st is None:
                stopped = self._stopped.get(req_id)
                ok, err = stopped is None, None if stopped is None else stopped[1]
                fired.append(lambda: on_done(req_id, ok, err))
            else:
                st.on_done = on_done
                self._settle(req_id, st, fired)
        run_callbacks(fired)

    def cancel(self, req_id: str, reason: str, peer: str | None, generation: int | None) -> None:
        """Sender side of ``FabricAgent.cancel``: post nothing more for ``req_id``; confirm
        ``SENDER_STOPPED`` once nothing is in flight (at once to a named ``peer`` if nothing
        was posted)."""
        fired: Fired = []
        with self._lock:
            st = self._sends.get(req_id)
            if st is not None:
                self._stop_send(req_id, st, reason, fired)
            elif peer is not None and generation is not None:
                old = self._stopped.get(req_id)
                if old is None or old[0] != generation:
                    self._remember_stopped(req_id, generation, reason)
                    to, gen = peer, generation
                    fired.append(lambda: self.notify(to, Kind.SENDER_STOPPED, req_id, gen))
        run_callbacks(fired)

    def pending(self) -> int:
        with self._lock:
            return len(self._sends)

    def busy(self) -> bool:
        """True while xfers are in flight (the progress thread then polls faster)."""
        return bool(self._inflight)

    # ---------------------------------------------------------------- notifications
    def notify(self, peer: str, kind: Kind, req_id: str, generation: int) -> None:
        """Send a standalone notification (``SENDER_STOPPED`` or ``CANCELLED_BY_RECEIVER``);
        a failure is logged, never raised. It takes the agent lock: call it with no other lock
        held (under a lock, append it to ``fired`` instead)."""
        try:
            with self._lock:
                self._nixl.send_notif(peer, pack(kind, generation, 0, req_id))
        except Exception as e:
            log.info("notification %s for %s to %s not sent: %s", kind.name, req_id, peer, e)

    def on_cancelled_by_receiver(self, receiver: str, req_id: str, generation: int, fired: Fired) -> None:
        """Progress thread: the receiver cancelled (or timed out) (req_id, generation)."""
        with self._lock:
            st = self._sends.get(req_id)
            if st is not None and st.generation == generation:
                self._stop_send(req_id, st, "cancelled by receiver", fired)
            elif st is None:  # nothing posted yet: refuse later posts, confirm now
                self._remember_stopped(req_id, generation, "cancelled by receiver")
                fired.append(lambda: self.notify(receiver, Kind.SENDER_STOPPED, req_id, generation))

    # ---------------------------------------------------------------- reaping (progress thread)
    def reap(self, fired: Fired) -> None:
        """Check in-flight xfers without holding the agent lock (NIXL itself is thread-safe in
        STRICT mode), then retire the finished ones under the lock."""
        with self._lock:
            batch = list(self._inflight)
        states: list[tuple[_Xfer, str, str | None]] = []
        for x in batch:
            try:
                states.append((x, self._nixl.check_xfer_state(x.handle), None))
            except Exception as e:  # e.g. nixlRemoteDisconnectError: the peer is gone
                states.append((x, "ERR", f"{type(e).__name__}: {e}"))
        now, retired = time.monotonic(), set()
        with self._lock:
            for x, state, exc in states:
                st = x.send
                if state == "PROC":
                    if now - x.posted_at <= self._xfer_timeout_s:
                        continue
                    self._fail(x.req_id, st, f"transfer still in progress after {self._xfer_timeout_s}s", fired)
                elif state == "ERR":
                    self._fail(x.req_id, st, f"transfer to {st.peer} failed: {exc or 'ERR state'}", fired)
                try:
                    x.handle.release()  # for a stuck transfer NIXL aborts it if it can
                except Exception as e:
                    log.warning("releasing xfer of %s (%s): %s", x.req_id, state, e)
                    if state == "PROC":
                        continue  # still in flight: keep its pages quarantined
                if x.stage_slot is not None:
                    self._tracker.release_slot(x.stage_slot)
                retired.add(id(x))
                st.inflight -= 1
                self._settle(x.req_id, st, fired)
            if retired:
                self._inflight = [x for x in self._inflight if id(x) not in retired]

    # ---------------------------------------------------------------- agent (lock held)
    def forget_indices(self) -> None:
        """Drop cached descriptor indices (a peer's lists are being released). Lock held."""
        self._index_cache.clear()

    def release_inflight(self) -> None:
        """At close, after the progress thread stopped: release every xfer handle. Lock held."""
        for x in self._inflight:
            try:
                x.handle.release()
            except Exception as e:
                log.warning("releasing an in-flight xfer at close: %s", e)
        self._inflight.clear()

    # ---------------------------------------------------------------- internals (lock held)
    def _fail(self, req_id: str, st: _Send, err: str, fired: Fired) -> None:
        if st.error is None:
            log.warning("request %s gen %d: %s", req_id, st.generation, err)
            if self._on_send_error is not None:
                cb, gen = self._on_send_error, st.generation
                fired.append(lambda: cb(req_id, gen, err))
        self._stop_send(req_id, st, err, fired)

    def _stop_send(self, req_id: str, st: _Send, reason: str, fired: Fired) -> None:
        st.error = st.error or reason
        st.stopping = True
        self._settle(req_id, st, fired)

    def _settle(self, req_id: str, st: _Send, fired: Fired) -> None:
        """Retire a request with nothing in flight that is finished or stopping."""
        if st.inflight or not (st.stopping or st.on_done is not None):
            return
        if self._sends.get(req_id) is st:
            del self._sends[req_id]
        if st.stopping:
            self._remember_stopped(req_id, st.generation, st.error or "stopped")
            peer, gen = st.peer, st.generation
            fired.append(lambda: self.notify(peer, Kind.SENDER_STOPPED, req_id, gen))
        if st.on_done is not None:
            cb, ok, err = st.on_done, st.error is None, st.error
            fired.append(lambda: cb(req_id, ok, err))

    @staticmethod
    def _release_unposted(h: Releasable) -> None:
        try:
            h.release()
        except Exception as e:
            log.warning("releasing an xfer whose post failed: %s", e)

    def _remember_stopped(self, req_id: str, generation: int, reason: str) -> None:
        self._stopped[req_id] = (generation, reason)
        while len(self._stopped) > _REMEMBER_STOPPED:
            self._stopped.popitem(last=False)
