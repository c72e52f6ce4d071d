"""The NIXL KV connector: :class:`NixlKVSender` (prefill role) and :class:`NixlKVReceiver`
(decode role) on top of ``fabric_bridge`` (one agent per instance, every TP shard of the
instance's pool registered once).

Sender bookkeeping, per request: before each step, the chunk of the request that the step
computes decides which destination pages become complete (full pages, or all of them at the
last chunk), so each page is sent exactly once and the receiver knows the count in advance;
after each layer has queued its KV write those pages' writes for that layer are posted (with
``stream_layers`` off, everything is posted after the prefill instead); after the last chunk
the last hidden state and logits go to the receiver's meta slot. Every post goes through the
:class:`~backend.disagg.poster.Poster`: it waits for the engine's device mark (the device has
executed the write, or computed the hidden state and logits) and keeps the order: a request's
layer posts, then its meta block or its cancellation, then ``finish_send``. The pages are
freed only when every write that reads them is done.

Receiver bookkeeping: the number of writes to expect (from both sides' layouts and the page
count), the deadline, and splitting the meta block back into (hidden state, logits).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from backend.disagg.config import ConnectorConfig
from backend.disagg.connector import (
    FreeableCallback,
    KVReceiver,
    KVSender,
    ReadyCallback,
    ReceiveTicket,
    ReleaseCallback,
    SendRequest,
)
from backend.disagg.poster import Poster
from backend.engine.outputs import EngineOutput, FinishReason
from backend.engine.protocol import DeviceMark, Engine, KVCacheSpec
from backend.engine.scheduler import StepBatch
from fabric_bridge.agent import FabricAgent
from fabric_bridge.layout import KVLayout
from fabric_bridge.plan import TransferPlan, build_plan, expected_writes

log = logging.getLogger("triton_disagg.connector")


def kv_layout(kv: KVCacheSpec) -> KVLayout:
    return KVLayout(
        model=kv.model,
        num_layers=kv.num_layers,
        page_size=kv.page_size,
        num_kv_heads=kv.num_kv_heads,
        head_dim=kv.head_dim,
        dtype=kv.dtype,
        tp_size=kv.tp_size,
        layout="HND",
        mem_kind="VRAM" if kv.device_type == "cuda" else "DRAM",
    )


def make_agent(
    engine: Engine,
    name: str,
    config: ConnectorConfig,
    on_send_error: Callable[[str, int, str], None] | None = None,
    etcd_host: str = "",
) -> FabricAgent:
    """The instance's fabric agent: its KV layout, every shard pool, the meta slots
    (``etcd_host``: the deployment's etcd, for the choice of network devices)."""
    kv, dims = engine.kv_cache(), engine.dims()
    return FabricAgent(
        name,
        kv_layout(kv),
        list(kv.shards),
        meta_slots=config.meta_slots,
        meta_slot_floats=dims.hidden_size + dims.vocab_size,
        backend=config.fabric_backend,
        quarantine_s=config.kv_quarantine_s,
        xfer_timeout_s=config.kv_xfer_timeout_s,
        on_send_error=on_send_error,
        net_devices=config.net_devices(etcd_host),
    )


@dataclass
class _SendJob:
    request: SendRequest
    dst_layout: KVLayout
    plan: TransferPlan | None = None
    sent_upto: int = 0  # page positions [0, sent_upto) are posted or planned
    step_positions: list[int] = field(default_factory=list)
    writes: int = 0
    t_start: float = field(default_factory=time.perf_counter)
    t_compute_done: float = 0.0

    @property
    def n_pages(self) -> int:
        return len(self.request.dst_pages)


class NixlKVSender(KVSender):
    """Prefill role (see the module docstring). ``on_send_error(req_id, reason)`` is told when a
    transfer fails so the prefill can be aborted; ``on_started(request)`` when the engine
    schedules a request's first chunk; ``on_progress(req_id, what, figures)`` (optional, for
    traces) at each chunk scheduled (``chunk``) and each layer's writes posted
    (``kv_layer_sent``), from the engine's and the poster's threads. ``etcd_host`` (both roles):
    the deployment's etcd, if the membership finds the peers (see ``ConnectorConfig.net_devices``)."""

    def __init__(
        self,
        engine: Engine,
        config: ConnectorConfig,
        name: str,
        on_send_error: Callable[[str, str], None],
        on_started: Callable[[SendRequest], None],
        etcd_host: str = "",
        on_progress: Callable[[str, str, dict], None] | None = None,
    ):
        self.engine = engine
        self._on_progress = on_progress
        self.layout = kv_layout(engine.kv_cache())
        self.page_size = self.layout.page_size
        self.stream_layers = config.stream_layers
        self._on_send_error = on_send_error
        self._on_started = on_started
        self.agent = make_agent(engine, name, config, on_send_error=self._send_error, etcd_host=etcd_host)
        self._poster = Poster(name, config.kv_xfer_timeout_s, self._post_failed)
        self.jobs: dict[str, _SendJob] = {}
        self._lock = threading.Lock()
        self._rng = random.Random()
        self.totals: dict[str, float] = {
            "kv_writes_total": 0,
            "kv_transfer_bytes_total": 0,
            "prefills_total": 0,
            "prefill_compute_seconds_total": 0.0,
            "kv_transfer_tail_seconds_total": 0.0,
        }
        engine.set_kv_listener(self, layer_events=self.stream_layers)

    # ------------------------------------------------------------ scheduler side
    def add_request(self, request: SendRequest) -> None:
        n, dst, first = request.n_tokens, request.dst_pages, request.first_page
        total = math.ceil(n / self.page_size) if n > 0 else 0
        if n < 1 or not 0 <= first < total:
            raise ValueError(f"first page {first} is not one of the {total} pages of {n} tokens")
        if len(dst) != total - first:
            raise ValueError(f"{n} tokens from page {first} on do not fill {len(dst)} destination pages")
        pages = self.agent.peer_pages(request.peer)
        if max(dst) >= pages:
            raise ValueError(f"destination page {max(dst)} is outside the receiver's pool of {pages} pages")
        if len(set(dst)) != len(dst):
            raise ValueError("destination pages repeat")
        layout = self.agent.peer_layout(request.peer)
        with self._lock:
            if request.req_id in self.jobs:
                raise ValueError("duplicate request id")
            self.jobs[request.req_id] = _SendJob(request, layout)

    def has(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self.jobs

    def request_finished(self, output: EngineOutput, on_freeable: FreeableCallback) -> None:
        job = self.jobs.get(output.req_id)
        if job is None:
            on_freeable(output.req_id, False, "unknown request")
            return
        job.t_compute_done = time.perf_counter()
        req = job.request
        computed = self.engine.device_mark()  # the hidden state and logits are on the device then
        if output.finish_reason == FinishReason.PREFILL_DONE:
            if not self.stream_layers:  # the switch for measuring overlap: send everything now
                self._poster.submit(computed, req.req_id, partial(self._post_all_layers, job))
            if req.slot is not None:
                hidden, logits = output.hidden_state, output.logits
                assert hidden is not None and logits is not None
                post = partial(self.agent.post_meta, req.peer, req.req_id, req.generation, req.slot, hidden, logits)
                self._poster.submit(computed, req.req_id, post)
        else:
            reason = output.error or output.finish_reason or "aborted"
            stop = partial(self.agent.cancel, req.req_id, reason, req.peer, req.generation)
            self._poster.submit(computed, req.req_id, stop)

        if output.finish_reason == FinishReason.PREFILL_DONE:
            outcome = "sent"
        elif output.finish_reason == FinishReason.ABORT:
            outcome = "cancelled"
        else:
            outcome = "failed"

        def done(req_id: str, ok: bool, err: str | None) -> None:
            with self._lock:
                finished = self.jobs.pop(req_id, None)
            if finished is not None:
                now = time.perf_counter()
                self.totals["prefills_total"] += 1
                self.totals["prefill_compute_seconds_total"] += finished.t_compute_done - finished.t_start
                self.totals["kv_transfer_tail_seconds_total"] += now - finished.t_compute_done
                log.info(
                    "prefill %s %s: %d tokens, %d writes, compute %.3fs, transfer tail %.3fs%s",
                    req_id,
                    outcome if ok else "failed",
                    finished.request.n_tokens,
                    finished.writes,
                    finished.t_compute_done - finished.t_start,
                    now - finished.t_compute_done,
                    f" ({err})" if err else "",
                )
            on_freeable(req_id, ok, err)

        # after every post queued for the request, so its pages are freed only after those writes
        self._poster.submit(computed, req.req_id, partial(self.agent.finish_send, req.req_id, done))

    def cancel(self, req_id: str, reason: str) -> None:
        with self._lock:
            job = self.jobs.get(req_id)
        if job is not None:
            self.agent.cancel(req_id, reason, job.request.peer, job.request.generation)

    # ------------------------------------------------------------ worker side (engine thread)
    def step_scheduled(self, batch: StepBatch) -> None:
        for c in batch.prefill_only_chunks:
            job = self.jobs.get(c.req_id)
            if job is None:
                continue
            first = job.request.first_page
            if job.plan is None:  # its first chunk: plan the writes, tell the receiver it began
                src_pages = self.engine.page_table(c.req_id)[first : first + job.n_pages]
                job.plan = build_plan(self.layout, job.dst_layout, src_pages, job.request.dst_pages, self._rng)
                self._on_started(job.request)
            # plan positions: page first + i of the prompt is position i (a cached prefix here is
            # complete before the first chunk: its pages go out with the first step's layers)
            ready = job.n_pages if c.is_last_chunk else max(0, (c.start + c.num_tokens) // self.page_size - first)
            job.step_positions = list(range(job.sent_upto, ready))
            job.sent_upto = max(job.sent_upto, ready)
            if self._on_progress is not None:
                chunk = {"triton_disagg.chunk.start": c.start, "triton_disagg.chunk.tokens": c.num_tokens}
                self._on_progress(c.req_id, "chunk", {**chunk, "triton_disagg.kv.pages": len(job.step_positions)})

    def layer_written(self, layer: int, batch: StepBatch, written: DeviceMark) -> None:
        for c in batch.prefill_only_chunks:
            job = self.jobs.get(c.req_id)
            if job is not None and job.step_positions:
                self._poster.submit(written, c.req_id, partial(self._post, job, layer, job.step_positions))

    def _post_all_layers(self, job: _SendJob) -> None:
        for layer in range(self.layout.num_layers):
            self._post(job, layer, range(job.n_pages))

    def _post(self, job: _SendJob, layer: int, positions: Sequence[int]) -> None:
        req, plan = job.request, job.plan
        assert plan is not None  # planned at the request's first chunk, before any layer is written
        if self.agent.post_layer(req.peer, req.req_id, req.generation, plan, layer, positions):
            n = plan.writes(positions)
            job.writes += n
            self.totals["kv_writes_total"] += n
            sent = len(positions) * sum(int(p.length.sum()) for p in plan.pairs)
            self.totals["kv_transfer_bytes_total"] += sent
            if self._on_progress is not None:
                figures = {"triton_disagg.layer": layer, "triton_disagg.kv.pages": len(positions)}
                self._on_progress(req.req_id, "kv_layer_sent", {**figures, "triton_disagg.kv.bytes": sent})

    def _post_failed(self, req_id: str, reason: str) -> None:
        """The poster could not post (the device did not finish, or posting raised)."""
        self.cancel(req_id, reason)
        self._on_send_error(req_id, reason)

    def _send_error(self, req_id: str, generation: int, err: str) -> None:
        log.warning("prefill %s: transfer error %s", req_id, err)
        self._on_send_error(req_id, err)

    def stats(self) -> dict:
        with self._lock:
            depth = len(self.jobs)
        return {"prefill_queue_depth": depth, "kv_posts_deferred_total": self._poster.deferred, **self.totals}

    def handshake_payload(self) -> dict:
        return self.agent.handshake_payload()

    def add_peer(self, payload: dict) -> str:
        return self.agent.add_peer(payload)

    def close(self) -> None:
        self._poster.close()
        self.agent.close()


@dataclass
class _Receive:
    n_pages: int
    expected: int
    t_start: float = field(default_factory=time.perf_counter)
    t_started: float | None = None  # the sender reported that it began the prefill


_MAX_PENDING_OBSERVATIONS = 10_000  # per histogram, between two metric refreshes


class NixlKVReceiver(KVReceiver):
    """Decode role (see the module docstring). ``source`` of :meth:`expect` is the sending
    instance's (peer name, KV layout). ``etcd_host``: as :class:`NixlKVSender`'s."""

    def __init__(self, engine: Engine, config: ConnectorConfig, name: str, etcd_host: str = ""):
        self.layout = kv_layout(engine.kv_cache())
        self.dims = engine.dims()
        self.timeout_s = config.kv_transfer_timeout_s
        self.queue_timeout_s = config.prefill_queue_timeout_s
        self.agent = make_agent(engine, name, config, etcd_host=etcd_host)
        self._active: dict[str, _Receive] = {}
        self._lock = threading.Lock()
        self.totals = {"kv_transfer_seconds_total": 0.0, "kv_transfer_bytes_total": 0, "kv_writes_total": 0}
        self._observed: dict[str, list[float]] = {"prefill_queue_time_seconds": [], "kv_transfer_time_seconds": []}

    def num_external_tokens(self, prompt_len: int) -> int:
        """All prompt tokens but the last come from a prefill instance; the last one is the
        first decode step."""
        return max(0, prompt_len - 1)

    def expect(
        self,
        req_id: str,
        n_tokens: int,
        source: tuple[str, KVLayout],
        on_ready: ReadyCallback,
        on_release: ReleaseCallback,
        first_page: int = 0,
    ) -> ReceiveTicket:
        peer, src_layout = source
        n_pages = math.ceil(n_tokens / self.layout.page_size) - first_page
        if n_pages < 1 or first_page < 0:
            raise ValueError(f"nothing to receive: {n_tokens} tokens from page {first_page} on")
        expected = expected_writes(src_layout, self.layout, n_pages)
        with self._lock:
            self._active[req_id] = _Receive(n_pages, expected)

        def done(rid: str, ok: bool, err: str | None, meta) -> None:
            with self._lock:
                rec = self._active.pop(rid, None)
            if ok and rec is not None:
                now = time.perf_counter()
                started = rec.t_started if rec.t_started is not None else rec.t_start
                with self._lock:
                    if rec.t_started is not None:
                        self._observe("prefill_queue_time_seconds", rec.t_started - rec.t_start)
                    self._observe("kv_transfer_time_seconds", now - started)
                self.totals["kv_transfer_seconds_total"] += now - rec.t_start
                self.totals["kv_writes_total"] += rec.expected
                self.totals["kv_transfer_bytes_total"] += self.bytes_of(rec.n_pages)
            on_ready(rid, ok, err, self.split_meta(meta) if ok else None)

        handle = self.agent.expect(
            req_id,
            expected,
            on_done=done,
            timeout_s=self.queue_timeout_s,  # until the prefill instance reports it started
            peer=peer,
            on_release=lambda rid, generation: on_release(rid),
            waiting_for="queued at the prefill instance",
        )
        return ReceiveTicket(handle.generation, handle.slot, n_pages, expected)

    def bytes_of(self, n_pages: int) -> int:
        """The KV bytes ``n_pages`` pages of every layer (and every TP rank) take: what a receive of
        them moves."""
        return n_pages * self.layout.num_layers * self.layout.page_bytes * self.layout.tp_size

    def started(self, req_id: str, generation: int) -> None:
        """The prefill instance began the request: from now on the transfer deadline applies, as
        the longest time without a landed write (a long prompt's prefill streams layers all along)."""
        with self._lock:
            rec = self._active.get(req_id)
            if rec is not None and rec.t_started is None:
                rec.t_started = time.perf_counter()
        self.agent.rearm(
            req_id, generation, self.timeout_s, f"prefill and transfer, no write for {self.timeout_s:g}s", True
        )

    def _observe(self, name: str, value: float) -> None:
        values = self._observed[name]
        if len(values) < _MAX_PENDING_OBSERVATIONS:
            values.append(value)

    def observations(self) -> dict[str, list[float]]:
        with self._lock:
            out, self._observed = self._observed, {k: [] for k in self._observed}
        return out

    def split_meta(self, meta):
        """The meta block (fp32 hidden ++ logits of the last prefilled position) as (hidden, logits)."""
        if meta is None:
            return None
        h = self.dims.hidden_size
        return meta[:h], meta[h : h + self.dims.vocab_size]

    def cancel(self, req_id: str, reason: str) -> None:
        self.agent.cancel(req_id, reason)

    def handshake_payload(self) -> dict:
        return self.agent.handshake_payload()

    def add_peer(self, payload: dict) -> str:
        return self.agent.add_peer(payload)

    def stats(self) -> dict:
        return dict(self.totals)

    def close(self) -> None:
        self.agent.close()
