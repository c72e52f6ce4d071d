"""Decode worker: allocates pages first, asks a prefill instance for the KV, then decodes.

For each request: reserve un-evictable pages (waiting in a bounded queue while the pool is
full), pick a prefill instance (least outstanding requests), tell the fabric agent how many
writes to expect, and send the prompt minus its last token with the destination pages over
the KV messenger. The request stays out of the decode batch until the completion counter has
seen every write and the metadata; then the engine runs the last prompt token as its first
decode step against the transferred cache. Failures (prefill lost, timeout, client gone)
end the request with a clear error; its pages are freed once no late write can land in them.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from fabric_bridge.plan import expected_writes

from backend.serving.worker_common import build_engine, deliver, pool_gauges, sampling_params, speculation_defaults
from backend.engine.engine_loop import EngineLoop
from backend.disagg.fabric_setup import kv_layout, make_agent
from backend.serving.session import GenerationSession
from backend.disagg.messenger import PrefillEndpoint, parse_endpoints
from backend.engine.page_allocator import PoolFullError

log = logging.getLogger("triton_disagg.decode")


@dataclass
class KVWait:
    session: GenerationSession
    endpoint: PrefillEndpoint
    n_pages: int
    expected: int
    t_start: float = field(default_factory=time.perf_counter)
    cancel_sent: bool = False


class DecodeWorker:
    def __init__(self, model_path: str, params: dict, name: str):
        self.name = name
        self.config, self.engine = build_engine(model_path, params)
        self.layout = kv_layout(self.engine)
        self.max_model_len = self.engine.max_model_len
        self.kv_timeout_s = float(params.get("kv_transfer_timeout_s", "20") or 20)
        self.max_waiting = int(params.get("max_waiting_for_pages", "32") or 32)
        self.page_wait_s = float(params.get("page_wait_timeout_s", "10") or 10)
        self.spec_defaults = speculation_defaults(params)
        self.agent = make_agent(self.engine, name, params, int(params.get("meta_slots", "64") or 64))
        self.loop = EngineLoop(self.engine, name=f"{name}-engine")
        self.endpoints = [PrefillEndpoint(h, p, self.agent, self._on_message, self._on_lost)
                          for h, p in parse_endpoints(params.get("prefill_endpoints", ""))]
        self._rr = itertools.count()
        self._lock = threading.RLock()   # fabric callbacks may re-enter from cancel()
        self.waiting_kv: dict[str, KVWait] = {}
        self.waiting_pages: deque[tuple[GenerationSession, float]] = deque()
        self.totals = {"kv_transfer_seconds_total": 0.0, "kv_transfer_bytes_total": 0, "kv_writes_total": 0}
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name=f"{name}-kv-watch", daemon=True)
        self._watcher.start()

    def describe(self) -> str:
        c = self.config
        return (f"decode on {c.torch_device}, KV pool {c.num_pages} pages x {c.page_size} tokens (HND), "
                f"prefill endpoints {[e.address for e in self.endpoints]}, KV timeout {self.kv_timeout_s}s")

    # ------------------------------------------------------------ admission
    def submit(self, session: GenerationSession) -> None:
        down = getattr(self.engine.runner, "failed", None)   # a tensor-parallel instance that lost a rank
        if down:
            session.on_output([], True, "error", f"decode instance {self.name}: {down}")
            return
        if len(session.prompt_ids) == 1:   # nothing to prefill: the first decode step is the prompt
            self.loop.submit(session.req_id, session.prompt_ids, sampling_params(session, self.spec_defaults),
                             lambda out: deliver(session, out))
            return
        with self._lock:
            if not self.waiting_pages and self._try_start(session):
                return
            if len(self.waiting_pages) >= self.max_waiting:
                overloaded = True
            else:
                overloaded = False
                self.waiting_pages.append((session, time.monotonic() + self.page_wait_s))
        if overloaded:
            session.on_output([], True, "error", f"overloaded: decode KV pool is full and "
                              f"{self.max_waiting} requests are already waiting for pages")

    def _try_start(self, session: GenerationSession) -> bool:
        """Reserve pages and send the prefill request; False if the pool is full (caller queues)."""
        n = len(session.prompt_ids)
        try:
            pages = self.loop.reserve(session.req_id, min(n + session.request.max_tokens, self.max_model_len - 1))
        except PoolFullError:
            return False
        endpoint = self._pick_endpoint()
        if endpoint is None:
            self.loop.cancel_reservation(session.req_id)
            errs = "; ".join(f"{e.address}: {e.last_error}" for e in self.endpoints)
            session.on_output([], True, "error", f"no prefill instance reachable ({errs})")
            return True
        n_pages = math.ceil((n - 1) / self.config.page_size)
        expected = expected_writes(endpoint.layout, self.layout, n_pages)
        handle = self.agent.expect(session.req_id, expected, on_done=self._on_kv_done,
                                   timeout_s=self.kv_timeout_s, peer=endpoint.peer,
                                   on_release=self._on_release)
        self.waiting_kv[session.req_id] = KVWait(session, endpoint, n_pages, expected)
        endpoint.outstanding.add(session.req_id)
        try:
            endpoint.send({"type": "prefill", "req_id": session.req_id, "generation": handle.generation,
                           "slot": handle.slot, "tokens": session.prompt_ids[:-1],
                           "dst_pages": pages[:n_pages]})
        except ConnectionError as e:
            self.agent.cancel(session.req_id, f"sending to prefill instance {endpoint.address} failed: {e}")
        return True

    def _pick_endpoint(self) -> Optional[PrefillEndpoint]:
        live = [e for e in self.endpoints if e.ensure_connected()]
        if not live:
            live = [e for e in self.endpoints if e.ensure_connected(force=True)]
        if not live:
            return None
        start = next(self._rr)
        order = live[start % len(live):] + live[:start % len(live)]
        return min(order, key=lambda e: len(e.outstanding))

    # ------------------------------------------------------------ completion (fabric thread)
    def _on_kv_done(self, req_id: str, ok: bool, err: Optional[str], meta) -> None:
        with self._lock:
            wait = self.waiting_kv.pop(req_id, None)
        if wait is None:
            return
        wait.endpoint.outstanding.discard(req_id)
        session = wait.session
        if not ok:
            if session.is_cancelled():
                session.on_output([], True, "cancelled")
            else:
                session.on_output([], True, "error",
                                  f"KV transfer from prefill instance {wait.endpoint.address} failed: {err}")
            return
        dt = time.perf_counter() - wait.t_start
        self.totals["kv_transfer_seconds_total"] += dt
        self.totals["kv_writes_total"] += wait.expected
        self.totals["kv_transfer_bytes_total"] += (wait.n_pages * self.layout.num_layers * self.layout.page_bytes
                                                   * self.layout.tp_size)
        self.loop.submit(req_id, session.prompt_ids, sampling_params(session, self.spec_defaults),
                         lambda out: deliver(session, out), kv_ready_tokens=len(session.prompt_ids) - 1,
                         prefill_state=self.split_meta(meta))

    def split_meta(self, meta):
        """The meta block (fp32 hidden ++ logits of the last prefilled position) as (hidden, logits)."""
        if meta is None:
            return None
        hidden_size = self.engine.runner.hf_config.hidden_size
        return meta[:hidden_size], meta[hidden_size: hidden_size + self.engine.runner.vocab_size]

    def _on_release(self, req_id: str, generation: int) -> None:
        """A failed request's pages can take no more writes: give them back."""
        try:
            self.loop.cancel_reservation(req_id)
        except (KeyError, ValueError) as e:
            log.warning("releasing pages of %s: %s", req_id, e)
        self._admit_waiting()

    # ------------------------------------------------------------ messenger (network threads)
    def _on_message(self, endpoint: PrefillEndpoint, msg: dict) -> None:
        if msg.get("type") == "error":
            self.agent.cancel(msg["req_id"], f"prefill instance {endpoint.address}: {msg.get('message')}")

    def _on_lost(self, endpoint: PrefillEndpoint, reason: str) -> None:
        for req_id in list(endpoint.outstanding):
            self.agent.cancel(req_id, f"prefill instance {endpoint.address} lost ({reason})")

    # ------------------------------------------------------------ watcher thread
    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            try:
                for e in self.endpoints:
                    if not e.connected:
                        e.ensure_connected()   # rate-limited; connects early so requests don't wait
                self._check_cancelled()
                self._admit_waiting()
            except Exception:
                log.exception("decode watcher failed")

    def _check_cancelled(self) -> None:
        with self._lock:
            gone = [w for w in self.waiting_kv.values() if not w.cancel_sent and w.session.is_cancelled()]
            for w in gone:
                w.cancel_sent = True
        for w in gone:
            log.info("request %s cancelled by the client while its prefill runs", w.session.req_id)
            try:
                w.endpoint.send({"type": "cancel", "req_id": w.session.req_id})
            except ConnectionError:
                pass
            self.agent.cancel(w.session.req_id, "cancelled by client")

    def _admit_waiting(self) -> None:
        now, failed = time.monotonic(), []
        with self._lock:
            while self.waiting_pages:
                session, deadline = self.waiting_pages[0]
                if session.is_cancelled() or deadline <= now:
                    self.waiting_pages.popleft()
                    failed.append(session)
                elif self._try_start(session):
                    self.waiting_pages.popleft()
                else:
                    break
        for s in failed:
            if s.is_cancelled():
                s.on_output([], True, "cancelled")
            else:
                s.on_output([], True, "error", f"overloaded: no KV pages free on the decode instance "
                            f"within {self.page_wait_s:.0f}s")

    # ------------------------------------------------------------ serving-layer interface
    def cancel(self, req_id: str) -> None:
        self.loop.cancel(req_id)

    def stats(self) -> dict:
        s = pool_gauges(self.engine.pool_stats())
        with self._lock:
            s["requests_waiting_kv"] = len(self.waiting_kv) + len(self.waiting_pages)
        s.update(self.totals)
        return s

    def shutdown(self) -> None:
        self._stop.set()
        for e in self.endpoints:
            e.close()
        self.loop.shutdown()
        self.agent.close()
