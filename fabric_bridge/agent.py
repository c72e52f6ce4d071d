"""FabricAgent: one per engine instance, moving KV pages of every TP shard it holds over NIXL.

This is the facade. It starts NIXL (``nixl_api.load()``: real NIXL, or what a test installed),
registers every per-layer KV pool of every shard and a small fp32 *meta buffer*
(``meta_slots`` x ``meta_slot_floats``: last hidden state + logits), connects peers
(:meth:`FabricAgent.add_peer` validates the peer's layout, loads its NIXL metadata and prepares
the descriptor lists for writing to it once, see ``peers.py``) and closes; the work is done by
its parts:

* ``sender.py`` -- :class:`~fabric_bridge.sender.Sender`: posts, per-request send state, xfers
  in flight and their reaping, ``finish_send``, the sender side of ``cancel``.
* ``completion.py`` -- :class:`~fabric_bridge.completion.CompletionTracker`: the receiving side
  (``expect``, ``rearm``, counters, timeouts, meta slots, quarantine, receiver-side cancel).
* ``progress.py`` -- :class:`~fabric_bridge.progress.ProgressLoop`: the background thread that
  reaps xfers, reads and dispatches notifications (``notifications.py``) and enforces timeouts.

Sender (prefill) side::

    plan = build_plan(my_layout, peer_layout, src_pages, dst_pages, rng)
    agent.post_layer(peer, req_id, generation, plan, layer)      # one xfer, returns at once
    agent.post_meta(peer, req_id, generation, slot, hidden, logits)
    agent.finish_send(req_id, on_done)   # on_done(req_id, ok, err) when all writes are done

Receiver (decode) side::

    h = agent.expect(req_id, expected_writes(...), on_done=cb, timeout_s=..., peer=peer)
    # send h.generation and h.slot to the sender; cb(req_id, ok, err, meta) / h.wait()

NIXL's own progress thread is off by default (``nixl_progress_thread=False``): it spins a full
core, which on a shared CPU costs more than it gains. Errors (peer gone, ``ERR`` state,
transfer stuck past ``xfer_timeout_s``) fail the request through ``on_send_error`` and
``finish_send``'s callback; they never raise into the engine. ``agent.stats`` counts xfers and
writes posted and the time spent posting.

Lock discipline -- the *agent lock* (``self._lock``, an RLock, shared with the Sender; the
Sender's docstring says what else it guards): here it guards the peer table (``_peers``) and
the NIXL calls that change it (``add_remote_agent``, ``prep_xfer_dlist`` for a peer, releasing a
peer's lists, ``remove_remote_agent``), and ``close``'s release of everything. Lookups of a
peer on the posting path read the dict without it. Taken by the handshake thread
(``add_peer``), the engine's threads (``peer_layout``, ``peer_pages``, ``pending``) and
``close`` (after the progress thread stopped). Never held while calling user code, nor while
calling into the CompletionTracker except through the Sender (tracker lock inside agent
lock, never the reverse). Registration and NIXL start happen in the constructor, before any
other thread exists.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from . import nixl_api
from .completion import CompletionTracker, DoneCallback, RecvHandle, ReleaseCallback
from .control import b64, unb64
from .layout import KVLayout, check_compatible
from .nixl_api import Releasable
from .notifications import Kind
from .peers import Peer, dlist_rows, meta_rows, seg_tables
from .plan import TransferPlan, all_pairs
from .progress import ProgressLoop
from .sender import ErrorCallback, SendCallback, Sender

log = logging.getLogger("triton_disagg.fabric")

ShardPools = Sequence[torch.Tensor | Sequence[torch.Tensor]]

__all__ = ["ErrorCallback", "FabricAgent", "SendCallback", "ShardPools", "TransportUnavailable"]


class TransportUnavailable(RuntimeError):
    """The configured NIXL transport cannot be started on this machine."""


def _mem_kind(t: torch.Tensor) -> str:
    return "DRAM" if t.device.type == "cpu" else "VRAM"


def _dev_id(t: torch.Tensor) -> int:
    return max(t.get_device(), 0)


def _layer_views(
    layout: KVLayout, shard: int, pool: torch.Tensor | Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Validate one shard's pools; return (per-layer views, tensors to register)."""
    stacked = isinstance(pool, torch.Tensor)
    layers = list(pool.unbind(0)) if isinstance(pool, torch.Tensor) else list(pool)
    if len(layers) != layout.num_layers:
        raise ValueError(f"shard {shard}: {len(layers)} layers, layout says {layout.num_layers}")
    page_shape = layout.page_shape()
    registered = [pool] if isinstance(pool, torch.Tensor) else layers
    for i, t in enumerate(registered):
        where = f"shard {shard}" + ("" if stacked else f" layer {i}")
        if str(t.dtype).removeprefix("torch.") != layout.dtype:
            raise ValueError(f"{where}: dtype {t.dtype}, layout says {layout.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{where}: KV pool must be contiguous")
        if _mem_kind(t) != layout.mem_kind:
            raise ValueError(f"{where}: tensor is {_mem_kind(t)}, layout says {layout.mem_kind}")
    n_pages = layers[0].shape[0]
    for i, t in enumerate(layers):
        if tuple(t.shape) != (n_pages, *page_shape):
            raise ValueError(
                f"shard {shard} layer {i}: shape {tuple(t.shape)}, expected "
                f"[{n_pages}, {', '.join(map(str, page_shape))}] ({layout.layout})"
            )
    return layers, registered


class FabricAgent:
    """One NIXL agent per engine instance (see module docstring)."""

    def __init__(
        self,
        name: str,
        layout: KVLayout,
        shards: ShardPools,
        meta_slots: int = 0,
        meta_slot_floats: int = 0,
        backend: str = "UCX",
        quarantine_s: float = 5.0,
        xfer_timeout_s: float = 30.0,
        on_send_error: ErrorCallback | None = None,
        nixl_progress_thread: bool = False,
        net_devices: str | None = None,
    ):
        if len(shards) != layout.tp_size:
            raise ValueError(f"{len(shards)} shard pools given, layout has TP {layout.tp_size}")
        self.name, self.layout, self.backend = name, layout, backend
        self._layers: list[list[torch.Tensor]] = []
        to_register: list[torch.Tensor] = []
        for s, pool in enumerate(shards):
            views, regs = _layer_views(layout, s, pool)
            self._layers.append(views)
            to_register += regs
        self._n_pages = [v[0].shape[0] for v in self._layers]
        self._devs = [_dev_id(v[0]) for v in self._layers]
        device = self._layers[0][0].device
        self.meta = (
            torch.zeros(meta_slots, meta_slot_floats, dtype=torch.float32, device=device) if meta_slots else None
        )
        if self.meta is not None:
            to_register.append(self.meta)

        if net_devices and backend == "UCX":
            # UCX reads its configuration when the backend starts: this process's agent (and a
            # TP rank started after it) listens and sends only on these devices
            os.environ["UCX_NET_DEVICES"] = net_devices
        self._nixl = self._start_nixl(name, backend, nixl_progress_thread)
        self._regs = [self._nixl.register_memory(t, backends=[backend]) for t in to_register]
        self._meta_local_dl: Releasable | None = None
        if self.meta is not None:
            rows = meta_rows(self.meta.data_ptr(), meta_slots, meta_slot_floats, _dev_id(self.meta))
            self._meta_local_dl = self._nixl.prep_xfer_dlist(
                "NIXL_INIT_AGENT", rows, layout.mem_kind, backends=[backend]
            )

        self._lock = threading.RLock()  # the agent lock (module docstring)
        self._peers: dict[str, Peer] = {}
        self._tracker = CompletionTracker(self.meta, quarantine_s)
        self._sender = Sender(
            self._nixl,
            self._lock,
            self._peers,
            layout,
            self._n_pages,
            self._tracker,
            self.meta,
            self._meta_local_dl,
            xfer_timeout_s,
            on_send_error,
        )
        self.stats = self._sender.stats
        self._progress = ProgressLoop(name, self._nixl, self._sender, self._tracker)
        self._progress.start()
        log.info(
            "fabric agent %s: %s, %d shard(s), %s pages/shard, backend %s, network devices %s",
            name,
            layout.layout,
            layout.tp_size,
            self._n_pages,
            backend,
            os.environ.get("UCX_NET_DEVICES", "all") if backend == "UCX" else "-",
        )

    # ---------------------------------------------------------------- setup / handshake
    @staticmethod
    def _start_nixl(name: str, backend: str, progress_thread: bool) -> Any:
        try:
            api = nixl_api.load()
        except ImportError as e:
            raise TransportUnavailable(f"NIXL transport {backend!r} cannot start: {e}") from e
        conf = api.nixl_agent_config(
            enable_prog_thread=progress_thread,
            backends=[backend],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        try:
            agent = api.nixl_agent(name, conf)
        except Exception as e:
            raise TransportUnavailable(
                f"NIXL transport {backend!r} failed to start on this machine "
                f"({type(e).__name__}: {e}); UCX is the default, LIBFABRIC needs EFA"
            ) from e
        if backend not in agent.backends:
            raise TransportUnavailable(
                f"NIXL transport {backend!r} is not available: no such plugin "
                f"(available plugins: {', '.join(agent.get_plugin_list())})"
            )
        return agent

    def handshake_payload(self) -> dict:
        """JSON-serialisable description of this agent for a peer (see ``control.py``)."""
        meta = None
        if self.meta is not None:
            meta = {
                "addr": self.meta.data_ptr(),
                "slots": self.meta.shape[0],
                "floats": self.meta.shape[1],
                "dev": _dev_id(self.meta),
            }
        return {
            "name": self.name,
            "md": b64(self._nixl.get_agent_metadata()),
            "layout": self.layout.to_dict(),
            "shards": [
                {"bases": [t.data_ptr() for t in views], "num_pages": n, "dev": d}
                for views, n, d in zip(self._layers, self._n_pages, self._devs)
            ],
            "meta": meta,
        }

    def add_peer(self, payload: dict) -> str:
        """Validate a peer's payload, load its NIXL metadata and prep the descriptor lists for
        writing to it. Raises ``LayoutMismatch`` naming the mismatch. Returns the peer name."""
        layout = KVLayout.from_dict(payload["layout"])
        check_compatible(self.layout, layout)
        meta = payload["meta"]
        if meta is not None and self.meta is not None and meta["floats"] != self.meta.shape[1]:
            raise ValueError(
                f"meta slot size differs: {self.meta.shape[1]} floats here, {meta['floats']} at peer {payload['name']}"
            )
        pairs = all_pairs(self.layout, layout)
        src_t, dst_t, pair_ids = seg_tables(pairs, self.layout.tp_size, layout.tp_size)
        local_rows, local_start = dlist_rows(
            [[t.data_ptr() for t in v] for v in self._layers], self._n_pages, self.layout.page_bytes, src_t, self._devs
        )
        shards = payload["shards"]
        remote_n = [s["num_pages"] for s in shards]
        remote_rows, remote_start = dlist_rows(
            [s["bases"] for s in shards], remote_n, layout.page_bytes, dst_t, [s["dev"] for s in shards]
        )
        with self._lock:
            if payload["name"] in self._peers:
                self._drop_peer(payload["name"])
            name = self._nixl.add_remote_agent(unb64(payload["md"]))
            name = name.decode() if isinstance(name, bytes) else name
            bk = [self.backend]
            peer = Peer(
                name,
                layout,
                remote_n,
                self._nixl.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows, self.layout.mem_kind, backends=bk),
                self._nixl.prep_xfer_dlist(name, remote_rows, layout.mem_kind, backends=bk),
                local_start,
                remote_start,
                [len(t) for t in src_t],
                [len(t) for t in dst_t],
                pair_ids,
                self._nixl.prep_xfer_dlist(
                    name,
                    meta_rows(meta["addr"], meta["slots"], meta["floats"], meta["dev"]),
                    layout.mem_kind,
                    backends=bk,
                )
                if meta is not None
                else None,
            )
            self._peers[name] = peer
        log.info(
            "fabric agent %s: peer %s added (%s TP %d -> %s TP %d, %d+%d descriptors)",
            self.name,
            name,
            self.layout.layout,
            self.layout.tp_size,
            layout.layout,
            layout.tp_size,
            len(local_rows),
            len(remote_rows),
        )
        return name

    def _drop_peer(self, name: str) -> None:
        """Agent lock held."""
        peer = self._peers.pop(name)
        self._sender.forget_indices()  # its indices point into the lists released here
        peer.release()
        self._nixl.remove_remote_agent(name)

    def peer_layout(self, peer: str) -> KVLayout:
        """A connected peer's KV layout (KeyError for an unknown peer)."""
        with self._lock:
            return self._peers[peer].layout

    def peer_pages(self, peer: str) -> int:
        """Pages in a connected peer's pool (its smallest shard)."""
        with self._lock:
            return min(self._peers[peer].n_pages)

    # ---------------------------------------------------------------- receiver side
    def expect(
        self,
        req_id: str,
        expected_writes: int,
        on_done: DoneCallback | None = None,
        timeout_s: float = 30.0,
        with_meta: bool | None = None,
        peer: str | None = None,
        on_release: ReleaseCallback | None = None,
        waiting_for: str = "transfer",
    ) -> RecvHandle:
        """Expect ``expected_writes`` KV writes (plus a meta block if ``with_meta``, default:
        when this agent has meta slots) for ``req_id``. ``peer`` is told to stop on
        cancel/timeout. ``on_release(req_id, generation)`` says when a failed request's pages
        may be reused. ``waiting_for`` names what ``timeout_s`` bounds in a timeout's message.
        Returns the handle whose ``generation`` and ``slot`` go to the sender."""
        with_meta = self.meta is not None if with_meta is None else with_meta
        handle = self._tracker.expect(
            req_id, expected_writes, on_done, timeout_s, with_meta, peer, on_release, waiting_for
        )
        self._progress.wake()
        return handle

    def rearm(
        self, req_id: str, generation: int, timeout_s: float, waiting_for: str, renew_on_writes: bool = False
    ) -> bool:
        """Move a request's receive deadline to ``timeout_s`` from now (see ``CompletionTracker.rearm``)."""
        rearmed = self._tracker.rearm(req_id, generation, timeout_s, waiting_for, renew_on_writes)
        self._progress.wake()
        return rearmed

    # ---------------------------------------------------------------- sender side
    def post_layer(
        self,
        peer: str,
        req_id: str,
        generation: int,
        plan: TransferPlan,
        layer: int,
        positions: Sequence[int] | None = None,
    ) -> bool:
        """Post one xfer writing layer ``layer`` of the plan's pages (``positions``: indices into
        the plan's page lists, e.g. the pages a prefill chunk filled; default all). Returns at
        once: True if posted, False if the request was cancelled or has failed."""
        posted = self._sender.post_layer(peer, req_id, generation, plan, layer, positions)
        self._progress.wake()
        return posted

    def post_meta(
        self, peer: str, req_id: str, generation: int, slot: int, hidden: torch.Tensor, logits: torch.Tensor
    ) -> bool:
        """Write ``hidden`` and ``logits`` (as fp32, concatenated) into the receiver's meta
        ``slot``. Staged through a free local meta slot (on a GPU: waits until the staging copy
        has run, so call it off the engine's thread; ``hidden`` and ``logits`` must be computed
        by then, or be produced on this thread's stream). Returns like :meth:`post_layer`."""
        posted = self._sender.post_meta(peer, req_id, generation, slot, hidden, logits)
        self._progress.wake()
        return posted

    def finish_send(self, req_id: str, on_done: SendCallback) -> None:
        """No more posts for ``req_id``; ``on_done(req_id, ok, err)`` fires once all its xfers
        are done (ok) or once it failed and nothing is in flight (source pages free again)."""
        self._sender.finish_send(req_id, on_done)
        self._progress.wake()

    # ---------------------------------------------------------------- both sides
    def cancel(
        self, req_id: str, reason: str = "cancelled", peer: str | None = None, generation: int | None = None
    ) -> None:
        """Cancel ``req_id``: as receiver, fail it, quarantine its pages and tell the sender to
        stop; as sender, post nothing more, and once in-flight writes are done tell the
        receiver (``S``) so it can reuse the pages. A sender that names the receiving ``peer``
        and ``generation`` tells it even when it has posted nothing yet."""
        stop = self._tracker.cancel(req_id, reason)
        if stop is not None and stop[0] is not None:
            self._sender.notify(stop[0], Kind.CANCELLED_BY_RECEIVER, req_id, stop[1])
        self._sender.cancel(req_id, reason, peer, generation)
        self._progress.wake()

    def pending(self) -> int:
        """Requests with state on this agent (in flight, expected or quarantined)."""
        return self._sender.pending() + self._tracker.pending()

    def close(self) -> None:
        """Stop the progress thread and release every NIXL resource."""
        self._progress.stop(timeout=10)
        with self._lock:
            self._sender.release_inflight()
            for name in list(self._peers):
                try:
                    self._drop_peer(name)
                except Exception as e:
                    log.warning("dropping peer %s at close: %s", name, e)
            if self._meta_local_dl is not None:
                self._meta_local_dl.release()
            for r in self._regs:
                self._nixl.deregister_memory(r, backends=[self.backend])
            self._regs.clear()
