"""Decode worker: allocates pages first, asks a prefill instance for the KV, then decodes.

For each request: reserve un-evictable pages (waiting in a bounded queue while the pool is
full), pick a prefill instance (by the KV it holds of the prompt and the prefills already queued
there, from the cache reports prefill instances send: ``backend/serving/kv_router.py``), tell the
KV receiver what to
expect (``backend/disagg/nixl_connector.py``) and send the prompt minus its last token with the
destination pages over the KV messenger. The request stays out of the decode batch until the
receiver has seen every write and the metadata; then the engine runs the last prompt token as
its first decode step against the transferred cache. Failures (prefill lost, timeout, client
gone) end the request with a clear error of a known kind; its pages are freed once no late
write can land in them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from backend.disagg import auth
from backend.disagg.messenger import PrefillEndpoint
from backend.disagg.nixl_connector import NixlKVReceiver
from backend.disagg.protocol import CacheReport, Cancel, Message, PrefillFailed, PrefillRequest, PrefillStarted
from backend.engine.cache_summary import CacheSummary
from backend.engine.engine_loop import EngineLoop
from backend.engine.outputs import ErrorKind, FinishReason
from backend.engine.page_allocator import PoolFullError
from backend.serving.config import InstanceConfig
from backend.serving.kv_router import KVRouter
from backend.serving.session import GenerationSession
from backend.serving.worker import deliver, pool_gauges, sampling_params, start_engine

log = logging.getLogger("triton_disagg.decode")


@dataclass
class KVWait:
    session: GenerationSession
    endpoint: PrefillEndpoint
    cancel_sent: bool = False


class DecodeWorker:
    def __init__(self, config: InstanceConfig, name: str):
        self.name = name
        self.config = config
        endpoints = config.connector.endpoints()  # refuses a decode model without prefill endpoints
        secret = auth.load_secret(config.connector.messenger_secret_file)  # none: refuse to start
        self.engine = start_engine(config)
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.dims().vocab_size
        self.receiver = NixlKVReceiver(self.engine, config.connector, name)
        self.loop = EngineLoop(self.engine, name=f"{name}-engine")
        self.endpoints = [
            PrefillEndpoint(h, p, self.receiver, name, secret, self._on_message, self._on_lost) for h, p in endpoints
        ]
        self.router = KVRouter(config.connector.kv_routing_weight)
        self._lock = threading.RLock()  # fabric callbacks may re-enter from cancel()
        self.waiting_kv: dict[str, KVWait] = {}
        self.waiting_pages: deque[tuple[GenerationSession, float]] = deque()
        # prefills run here (all cached but the last token, or short / prefill busy: see
        # ServingConfig.local_prefill_*) / by a prefill instance
        self.counters = {"prefill_local_total": 0, "prefill_remote_total": 0}
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name=f"{name}-kv-watch", daemon=True)
        self._watcher.start()

    def describe(self) -> str:
        c = self.config.engine
        return (
            f"decode on {c.torch_device}, KV pool {c.num_pages} pages x {c.page_size} tokens (HND), "
            f"prefill endpoints {[e.address for e in self.endpoints]}, "
            f"KV timeout {self.config.connector.kv_transfer_timeout_s}s"
        )

    # ------------------------------------------------------------ admission
    def submit(self, session: GenerationSession) -> None:
        down = self.engine.health()  # a tensor-parallel instance that lost a rank
        if down:
            session.fail(f"decode instance {self.name}: {down}", ErrorKind.OUT_OF_SERVICE)
            return
        if self.receiver.num_external_tokens(len(session.prompt_ids)) == 0:
            # nothing to prefill: the first decode step is the prompt
            self._run_here(session)
            return
        serving = self.config.serving
        with self._lock:
            if not self.waiting_pages and self._try_start(session):
                return
            overloaded = len(self.waiting_pages) >= serving.max_waiting_for_pages
            if not overloaded:
                self.waiting_pages.append((session, time.monotonic() + serving.page_wait_timeout_s))
        if overloaded:
            session.fail(
                f"decode KV pool is full and {serving.max_waiting_for_pages} requests are already waiting for pages",
                ErrorKind.OVERLOADED,
            )

    def _run_here(self, session: GenerationSession, kv_ready_tokens: int = 0, prefill_state=None) -> None:
        """Hand the request to this instance's engine (its KV ready up to ``kv_ready_tokens``)."""
        self.loop.submit(
            session.req_id,
            session.prompt_ids,
            sampling_params(session, self.config.serving),
            lambda out: deliver(session, out),
            kv_ready_tokens=kv_ready_tokens,
            prefill_state=prefill_state,
        )

    def _try_start(self, session: GenerationSession) -> bool:
        """Reserve pages (its cached prefix first) and send the prefill request for the pages
        this instance lacks, or, when it holds every page but the last token's, start the
        request here at once; False if the pool is full (caller queues)."""
        n = len(session.prompt_ids)
        try:
            pages = self.loop.reserve(
                session.req_id,
                min(n + session.request.max_tokens, self.max_model_len - 1),
                token_ids=session.prompt_ids,
            )
        except PoolFullError:
            return False
        n_remote = self.receiver.num_external_tokens(n)
        cached = self.loop.cached_tokens(session.req_id)
        if cached >= n_remote:  # the whole prefix is cached here: no prefill instance needed
            self.counters["prefill_local_total"] += 1
            self._run_here(session, kv_ready_tokens=n_remote)
            return True
        if self._prefill_here(n_remote - cached):
            # the engine admits it like an aggregated request: it attaches the cached prefix
            # again and computes the rest in its chunked prefill, between decode steps
            self.loop.cancel_reservation(session.req_id)
            self.counters["prefill_local_total"] += 1
            self._run_here(session)
            return True
        endpoint = self._pick_endpoint(session.req_id, session.prompt_ids[:n_remote], n_remote - cached)
        if endpoint is None:
            self.loop.cancel_reservation(session.req_id)
            session.fail(f"no prefill instance reachable ({self._endpoint_errors()})", ErrorKind.PREFILL_UNAVAILABLE)
            return True
        first_page = cached // self.config.engine.page_size
        ticket = self.receiver.expect(
            session.req_id,
            n_remote,
            (endpoint.peer, endpoint.layout),
            on_ready=self._on_kv_ready,
            on_release=self._on_release,
            first_page=first_page,
        )
        self.counters["prefill_remote_total"] += 1
        self.waiting_kv[session.req_id] = KVWait(session, endpoint)
        endpoint.outstanding.add(session.req_id)
        try:
            endpoint.send(
                PrefillRequest(
                    session.req_id,
                    ticket.generation,
                    ticket.slot,
                    session.prompt_ids[:n_remote],
                    pages[first_page : first_page + ticket.n_pages],
                    first_page,
                )
            )
        except ConnectionError as e:
            self.receiver.cancel(session.req_id, f"sending to prefill instance {endpoint.address} failed: {e}")
        return True

    def _prefill_here(self, uncached_tokens: int) -> bool:
        """Conditional disaggregation (see ``ServingConfig``): short enough, or every prefill
        instance is busy past the bound."""
        serving = self.config.serving
        if uncached_tokens <= serving.local_prefill_max_tokens:
            return True
        bound = serving.local_prefill_queue_bound
        return bool(bound) and all(len(e.outstanding) >= bound for e in self.endpoints)

    def _pick_endpoint(self, req_id: str, tokens: list[int], n_send: int) -> PrefillEndpoint | None:
        """The connected prefill instance with the lowest routing cost for the prefill of
        ``tokens``; its ``n_send`` tokens (the part to send) count as queued there until the KV
        has arrived."""
        live = [e for e in self.endpoints if e.ensure_connected()]
        if not live:
            live = [e for e in self.endpoints if e.ensure_connected(force=True)]
        if not live:
            return None
        by_address = {e.address: e for e in live}
        pages = -(-n_send // self.config.engine.page_size)
        return by_address[self.router.pick(req_id, tokens, list(by_address), pages)]

    # ------------------------------------------------------------ KV arrival (fabric thread)
    def _on_kv_ready(self, req_id: str, ok: bool, err: str | None, prefill_state) -> None:
        with self._lock:
            wait = self.waiting_kv.pop(req_id, None)
        if wait is None:
            return
        wait.endpoint.outstanding.discard(req_id)
        self.router.done(wait.endpoint.address, req_id)
        session = wait.session
        if not ok:
            if session.is_cancelled():
                session.on_output([], True, FinishReason.ABORT)
            else:
                session.fail(
                    f"KV transfer from prefill instance {wait.endpoint.address} failed: {err}",
                    ErrorKind.KV_TRANSFER_FAILED,
                )
            return
        self._run_here(session, self.receiver.num_external_tokens(len(session.prompt_ids)), prefill_state)

    def _on_release(self, req_id: str) -> None:
        """A failed request's pages can take no more writes: give them back."""
        try:
            self.loop.cancel_reservation(req_id)
        except (KeyError, ValueError) as e:
            log.warning("releasing pages of %s: %s", req_id, e)
        self._admit_waiting()

    # ------------------------------------------------------------ messenger (network threads)
    def _on_message(self, endpoint: PrefillEndpoint, msg: Message) -> None:
        if isinstance(msg, PrefillStarted):
            if msg.req_id in endpoint.outstanding:
                self.receiver.started(msg.req_id, msg.generation)
        elif isinstance(msg, PrefillFailed):
            if msg.req_id in endpoint.outstanding:
                self.receiver.cancel(msg.req_id, f"prefill instance {endpoint.address}: {msg.message}")
        elif isinstance(msg, CacheReport):
            self.router.update(endpoint.address, msg.summary)
        else:
            log.warning("unexpected %s from prefill instance %s", type(msg).__name__, endpoint.address)

    def _on_lost(self, endpoint: PrefillEndpoint, reason: str) -> None:
        self.router.forget(endpoint.address)  # it may come back empty
        for req_id in list(endpoint.outstanding):
            self.receiver.cancel(req_id, f"prefill instance {endpoint.address} lost ({reason})")

    # ------------------------------------------------------------ watcher thread
    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            try:
                for e in self.endpoints:
                    if not e.connected:
                        e.ensure_connected()  # rate-limited; connects early so requests don't wait
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
                w.endpoint.send(Cancel(w.session.req_id))
            except ConnectionError:
                pass
            self.receiver.cancel(w.session.req_id, "cancelled by client")

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
                s.on_output([], True, FinishReason.ABORT)
            else:
                s.fail(
                    f"no KV pages free on the decode instance within {self.config.serving.page_wait_timeout_s:.0f}s",
                    ErrorKind.OVERLOADED,
                )

    # ------------------------------------------------------------ serving-layer interface
    def cancel(self, req_id: str) -> None:
        self.loop.cancel(req_id)

    def health(self) -> str | None:
        down = self.engine.health()
        if down:
            return f"decode instance {self.name}: {down}"
        if not any(e.connected for e in self.endpoints):
            return f"decode instance {self.name}: no prefill instance connected ({self._endpoint_errors()})"
        return None

    def cache_summary(self) -> CacheSummary:
        with self._lock:
            waiting = len(self.waiting_kv) + len(self.waiting_pages)
        return dataclasses.replace(self.engine.cache_summary(), waiting=waiting)

    def _endpoint_errors(self) -> str:
        return "; ".join(f"{e.address}: {e.last_error}" for e in self.endpoints)

    def stats(self) -> dict:
        s = pool_gauges(self.engine.pool_stats())
        with self._lock:
            s["requests_waiting_kv"] = len(self.waiting_kv) + len(self.waiting_pages)
        s["prefill_endpoints_connected"] = sum(e.connected for e in self.endpoints)
        s.update(self.receiver.stats())
        s.update(self.counters)
        return s

    def observations(self) -> dict[str, list[float]]:
        return self.receiver.observations()

    def shutdown(self) -> None:
        self._stop.set()
        for e in self.endpoints:
            e.close()
        self.loop.shutdown()
        self.receiver.close()
        self.engine.close()
