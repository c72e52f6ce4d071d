"""Prefill worker: runs prompts (all tokens but the last) and streams their KV to decode instances.

Requests arrive from decode instances over the KV messenger with the destination pages and
the (generation, meta slot) the receiver expects. The engine runs them as prefill-only
requests in its continuous batches (chunked prefill, never samples). Before each step the
chunk hook decides which pages each chunk completes; after each layer has written its KV the
layer hook posts those pages' writes for that layer, so the transfer overlaps the compute of
later layers and chunks. Each page is sent exactly once (when full, or at the last chunk), so
the receiver knows the count in advance. After the last chunk the last hidden state and
logits go to the receiver's meta slot; when every write is done the pages are freed.
"""
from __future__ import annotations

import logging
import math
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from fabric_bridge.layout import KVLayout
from fabric_bridge.plan import TransferPlan, build_plan

from backend.serving.worker_common import build_engine, pool_gauges
from backend.engine.llm_engine import PREFILL_DONE, EngineOutput
from backend.engine.engine_loop import EngineLoop
from backend.disagg.fabric_setup import kv_layout, make_agent
from backend.disagg.messenger import Connection, MessengerServer
from backend.engine.sampling.params import SamplingParams
from backend.engine.scheduler import StepBatch

log = logging.getLogger("triton_disagg.prefill")


@dataclass
class PrefillJob:
    req_id: str
    peer: str
    conn: Connection
    generation: int
    slot: Optional[int]
    n_tokens: int
    dst_pages: list[int]
    dst_layout: KVLayout
    plan: Optional[TransferPlan] = None
    sent_upto: int = 0                      # page positions [0, sent_upto) are posted or planned
    step_positions: list[int] = field(default_factory=list)
    writes: int = 0
    t_start: float = field(default_factory=time.perf_counter)
    t_compute_done: float = 0.0

    @property
    def n_pages(self) -> int:
        return len(self.dst_pages)


class PrefillWorker:
    def __init__(self, model_path: str, params: dict, name: str):
        self.name = name
        self.config, self.engine = build_engine(model_path, params)
        self.page_size = self.config.page_size
        self.layout = kv_layout(self.engine)
        self.stream_layers = params.get("stream_layers", "true").lower() != "false"
        self.agent = make_agent(self.engine, name, params, int(params.get("meta_slots", "16") or 16),
                                on_send_error=self._on_send_error)
        self.jobs: dict[str, PrefillJob] = {}
        self._lock = threading.Lock()
        self._rng = random.Random()
        self.totals = {"kv_writes_total": 0, "kv_transfer_bytes_total": 0, "prefills_total": 0,
                       "prefill_compute_seconds_total": 0.0, "kv_transfer_tail_seconds_total": 0.0}
        self.engine.on_chunk_scheduled = self._on_chunk_scheduled
        self.engine.set_layer_hook(self._on_layer_kv_written if self.stream_layers else None)
        self.loop = EngineLoop(self.engine, name=f"{name}-engine")
        self.server = MessengerServer(self.agent, params.get("messenger_host", "127.0.0.1") or "127.0.0.1",
                                      int(params.get("messenger_port", "0") or 0), self._on_message,
                                      self._on_peer_lost, name)
        self.max_model_len = self.engine.max_model_len
        if hasattr(self.engine.runner, "on_failure"):   # tensor-parallel: a lost rank takes us out
            self.engine.runner.on_failure.append(self._out_of_service)

    def describe(self) -> str:
        c = self.config
        return (f"prefill on {c.torch_device}, KV pool {c.num_pages} pages x {c.page_size} tokens (HND), "
                f"messenger {self.server.host}:{self.server.port}, "
                f"{'layer-wise streaming' if self.stream_layers else 'send after prefill'}")

    # ------------------------------------------------------------ messenger (network threads)
    def _on_message(self, peer: str, msg: dict, conn: Connection) -> None:
        kind = msg.get("type")
        if kind == "prefill":
            self._start(peer, msg, conn)
        elif kind == "cancel":
            self._cancel(msg["req_id"], "cancelled by decode instance")
        else:
            log.warning("unknown messenger message %r from %s", kind, peer)

    def _start(self, peer: str, msg: dict, conn: Connection) -> None:
        req_id, tokens = msg["req_id"], msg["tokens"]
        dst_pages = msg["dst_pages"]
        if not tokens or len(dst_pages) != math.ceil(len(tokens) / self.page_size):
            conn.send({"type": "error", "req_id": req_id,
                       "message": f"{len(tokens)} tokens do not fill {len(dst_pages)} destination pages"})
            return
        job = PrefillJob(req_id, peer, conn, msg["generation"], msg.get("slot"), len(tokens), dst_pages,
                         self.server.peer_layouts[peer])
        with self._lock:
            if req_id in self.jobs:
                conn.send({"type": "error", "req_id": req_id, "message": "duplicate request id"})
                return
            self.jobs[req_id] = job
        log.debug("prefill %s: %d tokens -> %d pages of %s", req_id, len(tokens), job.n_pages, peer)
        self.loop.submit(req_id, tokens, SamplingParams(max_tokens=1), self._on_output, prefill_only=True)

    def _cancel(self, req_id: str, reason: str) -> None:
        if req_id in self.jobs:
            self.loop.cancel(req_id)
            self.agent.cancel(req_id, reason)

    def _on_peer_lost(self, peer: str, reason: str) -> None:
        with self._lock:
            lost = [j.req_id for j in self.jobs.values() if j.peer == peer]
        log.warning("decode instance %s lost (%s); cancelling %d prefill(s)", peer, reason, len(lost))
        for req_id in lost:
            self._cancel(req_id, f"decode instance lost: {reason}")

    # ------------------------------------------------------------ engine hooks (engine thread)
    def _on_chunk_scheduled(self, batch: StepBatch) -> None:
        for c in batch.prefill_only_chunks:
            job = self.jobs.get(c.req_id)
            if job is None:
                continue
            if job.plan is None:
                src_pages = self.engine.allocator.page_table(c.req_id)[:job.n_pages]
                job.plan = build_plan(self.layout, job.dst_layout, src_pages, job.dst_pages, self._rng)
            end = c.start + c.num_tokens
            ready = job.n_pages if c.is_last_chunk else end // self.page_size
            job.step_positions = list(range(job.sent_upto, ready))
            job.sent_upto = ready

    def _on_layer_kv_written(self, layer: int, batch: StepBatch) -> None:
        for c in batch.prefill_only_chunks:
            job = self.jobs.get(c.req_id)
            if job is not None and job.step_positions:
                self._post(job, layer, job.step_positions)

    def _post(self, job: PrefillJob, layer: int, positions) -> None:
        if self.agent.post_layer(job.peer, job.req_id, job.generation, job.plan, layer, positions):
            n = job.plan.writes(positions)
            job.writes += n
            self.totals["kv_writes_total"] += n
            self.totals["kv_transfer_bytes_total"] += len(positions) * sum(int(p.length.sum())
                                                                           for p in job.plan.pairs)

    # ------------------------------------------------------------ engine outputs (loop thread)
    def _on_output(self, out: EngineOutput) -> None:
        job = self.jobs.get(out.req_id)
        if job is None or not out.finished:
            return
        job.t_compute_done = time.perf_counter()
        if out.finish_reason == PREFILL_DONE:
            if not self.stream_layers:   # the switch for measuring overlap: send everything now
                for layer in range(self.layout.num_layers):
                    self._post(job, layer, range(job.n_pages))
            if job.slot is not None:
                self.agent.post_meta(job.peer, job.req_id, job.generation, job.slot,
                                     out.hidden_state, out.logits)
        else:
            reason = out.error or out.finish_reason or "aborted"
            self.agent.cancel(out.req_id, reason)
            if out.finish_reason == "error":
                try:
                    job.conn.send({"type": "error", "req_id": out.req_id, "message": reason})
                except ConnectionError:
                    pass
        self.agent.finish_send(out.req_id, self._on_sent)

    def _on_sent(self, req_id: str, ok: bool, err: Optional[str]) -> None:
        """All writes of the request are done (or it failed and nothing is in flight)."""
        with self._lock:
            job = self.jobs.pop(req_id, None)
        freed = self.loop.release(req_id)
        if job is not None:
            now = time.perf_counter()
            self.totals["prefills_total"] += 1
            self.totals["prefill_compute_seconds_total"] += job.t_compute_done - job.t_start
            self.totals["kv_transfer_tail_seconds_total"] += now - job.t_compute_done
            log.info("prefill %s %s: %d tokens, %d writes, compute %.3fs, transfer tail %.3fs, "
                     "%d pages freed%s", req_id, "sent" if ok else "failed", job.n_tokens, job.writes,
                     job.t_compute_done - job.t_start, now - job.t_compute_done, freed,
                     f" ({err})" if err else "")

    def _on_send_error(self, req_id: str, generation: int, err: str) -> None:
        log.warning("prefill %s: transfer error %s; aborting it", req_id, err)
        self.loop.cancel(req_id)

    def _out_of_service(self, reason: str) -> None:
        """Fail every job with ``reason`` and stop listening, so decode instances route elsewhere."""
        with self._lock:
            jobs = list(self.jobs.values())
        for job in jobs:
            try:
                job.conn.send({"type": "error", "req_id": job.req_id, "message": reason})
            except ConnectionError:
                pass
        if jobs:   # let the reasons land before the engine fails the jobs (their "sender stopped" races them)
            time.sleep(0.5)
        self.server.close()

    # ------------------------------------------------------------ serving-layer interface
    def stats(self) -> dict:
        s = pool_gauges(self.engine.pool_stats())
        s["prefill_queue_depth"] = len(self.jobs)
        s.update(self.totals)
        return s

    def shutdown(self) -> None:
        self.server.close()
        self.loop.shutdown()
        self.agent.close()
