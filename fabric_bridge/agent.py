"""NIXL agent wrapper: one per engine instance, moving KV pages of every TP shard it holds.

At construction the agent registers every per-layer KV pool of every shard and a small
fp32 *meta buffer* (``meta_slots`` x ``meta_slot_floats``: last hidden state + logits) with
NIXL. :meth:`FabricAgent.add_peer` validates the peer's layout, loads its NIXL metadata and
builds the two prepped descriptor lists for writing to it (every in-page segment of every
page of every layer of every shard, local and remote) once. A post then only computes
indices into those lists (numpy) and calls ``make_prepped_xfer`` + ``transfer``.

Sender (prefill) side::

    plan = build_plan(my_layout, peer_layout, src_pages, dst_pages, rng)
    agent.post_layer(peer, req_id, generation, plan, layer)      # one xfer, returns at once
    agent.post_meta(peer, req_id, generation, slot, hidden, logits)
    agent.finish_send(req_id, on_done)   # on_done(req_id, ok, err) when all writes are done

Receiver (decode) side::

    h = agent.expect(req_id, expected_writes(...), on_done=cb, timeout_s=..., peer=peer)
    # send h.generation and h.slot to the sender; cb(req_id, ok, err, meta) / h.wait()

A background *progress thread* reaps transfers (``check_xfer_state``, releasing handles),
reads notifications and enforces timeouts; these calls also drive UCX progress. NIXL's own
progress thread is off by default (``nixl_progress_thread=False``): it spins a full core,
which on a shared CPU costs more than it gains. Notification messages are
``b"<kind>:<generation>:<n>:<req_id>"`` with kinds ``W`` (n KV writes landed), ``M`` (meta
block of n floats landed), ``X`` (receiver cancelled: stop sending) and ``S`` (sender stopped,
nothing in flight: the receiver may reuse the request's pages, see ``completion.py``).
Errors (peer gone, ``ERR`` state, transfer stuck past ``xfer_timeout_s``) fail the request
through ``on_send_error`` and ``finish_send``'s callback; they never raise into the engine.
``agent.stats`` counts xfers and writes posted and the time spent posting.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .completion import CompletionTracker, DoneCallback, RecvHandle, ReleaseCallback
from .control import b64, unb64
from .layout import KVLayout, check_compatible
from .nixl_api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
from .plan import TransferPlan, all_pairs

log = logging.getLogger("triton_disagg.fabric")

SendCallback = Callable[[str, bool, str | None], None]
ErrorCallback = Callable[[str, int, str], None]
ShardPools = Sequence[torch.Tensor | Sequence[torch.Tensor]]

_REMEMBER_STOPPED = 4096  # stopped (req_id -> generation) kept to drop late posts
_INDEX_CACHE = 64  # (plan, positions) whose descriptor indices are kept for the next layers' posts


class TransportUnavailable(RuntimeError):
    """The configured NIXL transport cannot be started on this machine."""


def _mem_kind(t: torch.Tensor) -> str:
    return "DRAM" if t.device.type == "cpu" else "VRAM"


def _dev_id(t: torch.Tensor) -> int:
    return max(t.get_device(), 0)


def _layer_views(layout: KVLayout, shard: int, pool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Validate one shard's pools; return (per-layer views, tensors to register)."""
    stacked = isinstance(pool, torch.Tensor)
    layers = list(pool.unbind(0)) if stacked else list(pool)
    if len(layers) != layout.num_layers:
        raise ValueError(f"shard {shard}: {len(layers)} layers, layout says {layout.num_layers}")
    page_shape = layout.page_shape()
    for i, t in enumerate([pool] if stacked else layers):
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
    return layers, [pool] if stacked else layers


def _dlist(
    bases: list[list[int]], n_pages: list[int], page_bytes: int, tables: list[dict], devs: list[int]
) -> tuple[np.ndarray, list[int]]:
    """Descriptor rows ``(addr, len, dev)`` for every shard/layer/page/segment, and the row
    where each shard starts. Row of (s, layer, page, seg) = start[s] + (layer*n_pages[s] +
    page) * len(tables[s]) + seg."""
    rows, starts, n = [], [], 0
    for s, table in enumerate(tables):
        starts.append(n)
        if not table:
            continue
        segs = np.array(list(table), dtype=np.uint64)  # insertion order == segment id
        addr = (
            np.array(bases[s], dtype=np.uint64)[:, None, None]
            + (np.arange(n_pages[s], dtype=np.uint64) * np.uint64(page_bytes))[None, :, None]
            + segs[None, None, :, 0]
        )
        block = np.empty((addr.size, 3), dtype=np.uint64)
        block[:, 0] = addr.ravel()
        block[:, 1] = np.broadcast_to(segs[:, 1], addr.shape).ravel()
        block[:, 2] = devs[s]
        rows.append(block)
        n += len(block)
    return np.concatenate(rows), starts


def _seg_tables(pairs, n_src: int, n_dst: int):
    """Per-shard segment ids: {(offset, length): id} for the source and destination sides,
    and per shard pair the (source ids, destination ids) of its segments."""
    src_t = [dict() for _ in range(n_src)]
    dst_t = [dict() for _ in range(n_dst)]
    pair_ids = {}
    for p in pairs:
        sid = [
            src_t[p.src_shard].setdefault((int(o), int(n)), len(src_t[p.src_shard]))
            for o, n in zip(p.src_off, p.length)
        ]
        did = [
            dst_t[p.dst_shard].setdefault((int(o), int(n)), len(dst_t[p.dst_shard]))
            for o, n in zip(p.dst_off, p.length)
        ]
        pair_ids[(p.src_shard, p.dst_shard)] = (np.array(sid, dtype=np.int64), np.array(did, dtype=np.int64))
    return src_t, dst_t, pair_ids


@dataclass
class _Peer:
    name: str
    layout: KVLayout
    n_pages: list[int]
    local_dl: object
    remote_dl: object
    local_start: list[int]
    remote_start: list[int]
    local_nseg: list[int]
    remote_nseg: list[int]
    pair_ids: dict
    meta_dl: object | None


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
    handle: object
    req_id: str
    send: _Send
    posted_at: float
    stage_slot: int | None = None


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
        self._xfer_timeout_s, self._on_send_error = xfer_timeout_s, on_send_error
        self._layers, to_register = [], []
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
        self._meta_local_dl = (
            self._nixl.prep_xfer_dlist(
                "NIXL_INIT_AGENT",
                self._meta_rows(self.meta.data_ptr(), meta_slots, meta_slot_floats, _dev_id(self.meta)),
                layout.mem_kind,
                backends=[backend],
            )
            if self.meta is not None
            else None
        )

        self._tracker = CompletionTracker(self.meta, quarantine_s)
        self._peers: dict[str, _Peer] = {}
        self._sends: dict[str, _Send] = {}
        self._stopped: OrderedDict[str, tuple[int, str]] = OrderedDict()
        self._inflight: list[_Xfer] = []
        self._index_cache: OrderedDict[tuple, tuple] = OrderedDict()
        self._lock = threading.RLock()
        # Posting telemetry: time in make_prepped_xfer and in transfer() (where a transport
        # that copies synchronously, like UCX's cma, does its work), xfers and writes posted.
        self.stats = {"make_xfer_s": 0.0, "transfer_call_s": 0.0, "xfers": 0, "writes": 0}
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._progress_loop, name=f"fabric-{name}", daemon=True)
        self._thread.start()
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
    def _start_nixl(name: str, backend: str, progress_thread: bool) -> nixl_agent:
        conf = nixl_agent_config(
            enable_prog_thread=progress_thread, backends=[backend], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        try:
            agent = nixl_agent(name, conf)
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

    @staticmethod
    def _meta_rows(addr: int, slots: int, floats: int, dev: int) -> np.ndarray:
        rows = np.empty((slots, 3), dtype=np.uint64)
        rows[:, 0] = addr + np.arange(slots, dtype=np.uint64) * np.uint64(floats * 4)
        rows[:, 1] = floats * 4
        rows[:, 2] = dev
        return rows

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
        src_t, dst_t, pair_ids = _seg_tables(pairs, self.layout.tp_size, layout.tp_size)
        local_rows, local_start = _dlist(
            [[t.data_ptr() for t in v] for v in self._layers], self._n_pages, self.layout.page_bytes, src_t, self._devs
        )
        shards = payload["shards"]
        remote_n = [s["num_pages"] for s in shards]
        remote_rows, remote_start = _dlist(
            [s["bases"] for s in shards], remote_n, layout.page_bytes, dst_t, [s["dev"] for s in shards]
        )
        with self._lock:
            if payload["name"] in self._peers:
                self._drop_peer(payload["name"])
            name = self._nixl.add_remote_agent(unb64(payload["md"]))
            name = name.decode() if isinstance(name, bytes) else name
            bk = [self.backend]
            peer = _Peer(
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
                    self._meta_rows(meta["addr"], meta["slots"], meta["floats"], meta["dev"]),
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
        peer = self._peers.pop(name)
        self._index_cache.clear()  # its indices point into the lists released here
        for dl in (peer.local_dl, peer.remote_dl, peer.meta_dl):
            if dl is not None:
                dl.release()
        self._nixl.remove_remote_agent(name)

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
        return self._tracker.expect(
            req_id, expected_writes, on_done, timeout_s, with_meta, peer, on_release, waiting_for
        )

    def peer_layout(self, peer: str) -> KVLayout:
        """A connected peer's KV layout (KeyError for an unknown peer)."""
        with self._lock:
            return self._peers[peer].layout

    def peer_pages(self, peer: str) -> int:
        """Pages in a connected peer's pool (its smallest shard)."""
        with self._lock:
            return min(self._peers[peer].n_pages)

    def rearm(
        self, req_id: str, generation: int, timeout_s: float, waiting_for: str, renew_on_writes: bool = False
    ) -> bool:
        """Move a request's receive deadline to ``timeout_s`` from now (see ``CompletionTracker.rearm``)."""
        return self._tracker.rearm(req_id, generation, timeout_s, waiting_for, renew_on_writes)

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
        p = self._peers[peer]
        if not 0 <= layer < self.layout.num_layers:
            raise IndexError(f"layer {layer} out of range")
        idx = self._step_indices(p, plan, positions)
        if idx is None:
            return True
        li, ri = idx[0][layer], idx[1][layer]
        msg = f"W:{generation}:{len(li)}:{req_id}".encode()
        return self._post(p, req_id, generation, p.local_dl, li, p.remote_dl, ri, msg, None)

    def _step_indices(self, p: _Peer, plan: TransferPlan, positions: Sequence[int] | None):
        """Descriptor indices of the plan's pages at ``positions``, local and remote, for every
        layer at once (two ``[layers, descriptors]`` arrays), or None for no pages. The layers of
        one step post the same positions, so the last few results are kept: a layer's post then
        takes its row of each (the plan's layouts are checked once, when its indices are made)."""
        key = (id(plan), p.name, None if positions is None else tuple(positions))
        hit = self._index_cache.get(key)  # one dict read, atomic: no lock taken on a hit
        if hit is not None and hit[0] is plan:
            return hit[1]
        if plan.src != self.layout or plan.dst != p.layout:
            raise ValueError("plan was built for other layouts than this agent and peer")
        sel = slice(None) if positions is None else np.asarray(positions, dtype=np.int64)
        sp, dp = plan.src_pages[sel], plan.dst_pages[sel]
        if len(sp) == 0:
            return None
        layers = np.arange(self.layout.num_layers, dtype=np.int64)[:, None]
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
        out = tuple(np.concatenate(a, axis=1).astype(np.int32) for a in (local, remote))
        with self._lock:
            self._index_cache[key] = (plan, out)
            while len(self._index_cache) > _INDEX_CACHE:
                self._index_cache.popitem(last=False)
        return out

    def post_meta(
        self, peer: str, req_id: str, generation: int, slot: int, hidden: torch.Tensor, logits: torch.Tensor
    ) -> bool:
        """Write ``hidden`` and ``logits`` (as fp32, concatenated) into the receiver's meta
        ``slot``. Staged through a free local meta slot (on a GPU: waits until the staging copy
        has run, so call it off the engine's thread; ``hidden`` and ``logits`` must be computed
        by then, or be produced on this thread's stream). Returns like :meth:`post_layer`."""
        p = self._peers[peer]
        if p.meta_dl is None or self.meta is None:
            raise ValueError("meta write needs meta slots on both agents")
        flat = torch.cat([hidden.reshape(-1), logits.reshape(-1)]).to(torch.float32)
        if flat.numel() > self.meta.shape[1]:
            raise ValueError(f"meta block of {flat.numel()} floats exceeds the slot size {self.meta.shape[1]}")
        stage = self._tracker.acquire_slot()
        self.meta[stage, : flat.numel()].copy_(flat)
        if self.meta.is_cuda:  # the copy is queued on this thread's stream: NIXL must read it done
            staged = torch.cuda.Event()
            staged.record()
            staged.synchronize()
        msg = f"M:{generation}:{flat.numel()}:{req_id}".encode()
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
        self, p: _Peer, req_id: str, generation: int, local_dl, li, remote_dl, ri, msg, stage: int | None
    ) -> bool:
        fired, posted = [], False
        with self._lock:
            st = self._sends.get(req_id)
            if st is None or st.generation != generation:
                old = self._stopped.get(req_id)
                if old is not None and old[0] == generation:
                    return False
                st = self._sends[req_id] = _Send(p.name, generation)
            if st.stopping:
                return False
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
                self._fail(req_id, st, f"posting to {p.name} failed: {type(e).__name__}: {e}", fired)
            else:
                self._inflight.append(_Xfer(h, req_id, st, time.monotonic(), stage))
                st.inflight += 1
                posted = state != "ERR"
                if not posted:
                    self._fail(req_id, st, f"transfer to {p.name} failed at post (ERR)", fired)
        self._run(fired)
        return posted

    def finish_send(self, req_id: str, on_done: SendCallback) -> None:
        """No more posts for ``req_id``; ``on_done(req_id, ok, err)`` fires once all its xfers
        are done (ok) or once it failed and nothing is in flight (source pages free again)."""
        fired = []
        with self._lock:
            st = self._sends.get(req_id)
            if st is None:
                stopped = self._stopped.get(req_id)
                fired.append(lambda: on_done(req_id, stopped is None, None if stopped is None else stopped[1]))
            else:
                st.on_done = on_done
                self._settle(req_id, st, fired)
        self._run(fired)

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
            self._notify(stop[0], "X", req_id, stop[1])
        fired = []
        with self._lock:
            st = self._sends.get(req_id)
            if st is not None:
                self._stop_send(req_id, st, reason, fired)
            elif peer is not None and generation is not None and self._stopped.get(req_id, (None,))[0] != generation:
                self._stopped[req_id] = (generation, reason)
                while len(self._stopped) > _REMEMBER_STOPPED:
                    self._stopped.popitem(last=False)
                fired.append(lambda: self._notify(peer, "S", req_id, generation))
        self._run(fired)

    def pending(self) -> int:
        """Requests with state on this agent (in flight, expected or quarantined)."""
        with self._lock:
            return len(self._sends) + self._tracker.pending()

    def close(self) -> None:
        """Stop the progress thread and release every NIXL resource."""
        self._closing.set()
        self._thread.join(timeout=10)
        with self._lock:
            for x in self._inflight:
                try:
                    x.handle.release()
                except Exception as e:
                    log.warning("releasing an in-flight xfer at close: %s", e)
            self._inflight.clear()
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

    # ---------------------------------------------------------------- internals
    def _fail(self, req_id: str, st: _Send, err: str, fired: list) -> None:
        if st.error is None:
            log.warning("request %s gen %d: %s", req_id, st.generation, err)
            if self._on_send_error is not None:
                cb, gen = self._on_send_error, st.generation
                fired.append(lambda: cb(req_id, gen, err))
        self._stop_send(req_id, st, err, fired)

    def _stop_send(self, req_id: str, st: _Send, reason: str, fired: list) -> None:
        st.error = st.error or reason
        st.stopping = True
        self._settle(req_id, st, fired)

    def _settle(self, req_id: str, st: _Send, fired: list) -> None:
        """Retire a request with nothing in flight that is finished or stopping."""
        if st.inflight or not (st.stopping or st.on_done is not None):
            return
        if self._sends.get(req_id) is st:
            del self._sends[req_id]
        if st.stopping:
            self._stopped[req_id] = (st.generation, st.error)
            while len(self._stopped) > _REMEMBER_STOPPED:
                self._stopped.popitem(last=False)
            peer, gen = st.peer, st.generation
            fired.append(lambda: self._notify(peer, "S", req_id, gen))
        if st.on_done is not None:
            cb, ok, err = st.on_done, st.error is None, st.error
            fired.append(lambda: cb(req_id, ok, err))

    def _notify(self, peer: str, kind: str, req_id: str, generation: int) -> None:
        try:
            with self._lock:
                self._nixl.send_notif(peer, f"{kind}:{generation}:0:{req_id}".encode())
        except Exception as e:
            log.info("notification %s for %s to %s not sent: %s", kind, req_id, peer, e)

    @staticmethod
    def _run(fired: list) -> None:
        for f in fired:
            try:
                f()
            except Exception:
                log.exception("fabric callback raised")

    def _reap(self, fired: list) -> None:
        """Check in-flight xfers without holding the agent lock (NIXL itself is thread-safe in
        STRICT mode), then retire the finished ones under the lock."""
        with self._lock:
            batch = list(self._inflight)
        states = []
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

    def _on_notif(self, sender: str, msg: bytes, fired: list) -> None:
        try:
            kind, gen, n, req_id = msg.decode().split(":", 3)
            gen, n = int(gen), int(n)
        except ValueError:
            log.warning("ignoring malformed notification %r from %s", msg, sender)
            return
        if kind == "W":
            self._tracker.writes_landed(req_id, gen, n)
        elif kind == "M":
            self._tracker.meta_landed(req_id, gen, n)
        elif kind == "S":
            self._tracker.sender_stopped(req_id, gen)
        elif kind == "X":
            with self._lock:
                st = self._sends.get(req_id)
                if st is not None and st.generation == gen:
                    self._stop_send(req_id, st, "cancelled by receiver", fired)
                elif st is None:  # nothing posted yet: refuse later posts, confirm now
                    self._stopped[req_id] = (gen, "cancelled by receiver")
                    fired.append(lambda: self._notify(sender, "S", req_id, gen))

    def _progress_loop(self) -> None:
        while not self._closing.is_set():
            fired, busy = [], False
            try:
                self._reap(fired)
                notifs = self._nixl.get_new_notifs()
                busy = bool(self._inflight or notifs or self._tracker.expecting())
                for sender, msgs in notifs.items():
                    sender = sender.decode() if isinstance(sender, bytes) else sender
                    for m in msgs:
                        self._on_notif(sender, m, fired)
                for req_id, peer, gen in self._tracker.tick():
                    if peer is not None:
                        self._notify(peer, "X", req_id, gen)
            except Exception:
                log.exception("fabric progress loop error")
            self._run(fired)
            # Poll gently: on a prefill instance this thread shares the cores (and the GIL)
            # with the engine; polling at 5 kHz while writes were in flight cost ~8% of the
            # prefill compute. Completions only free pages and count writes, so 1 ms is plenty.
            time.sleep(0.001 if busy else 0.002)
