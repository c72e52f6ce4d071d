"""Decode worker: allocates pages first, asks a prefill instance for the KV, then decodes.

Every request goes to the engine as a ``remote_kv`` request: the engine's scheduler admits it like
any other (pages, its cached prefix first; a request waits there while the pool is full), then
asks this worker (its KV loader, :meth:`DecodeWorker.load`) whether the rest of the prompt's KV
comes from a prefill instance. It does unless the prefix cache holds all of it, or the uncached
part is short or every prefill instance is busy (conditional disaggregation, ``ServingConfig``):
then the engine computes it here. A remote request waits in the engine, holding its pages, while
this worker picks a prefill instance (by the KV it holds and its queue: ``kv_router.py``), tells
the KV receiver what to expect (``backend/disagg/nixl_connector.py``) and sends the prompt minus
its last token with the destination pages over the messenger. When every write and the metadata
have landed, the engine runs the last prompt token as the first decode step.

One loop owns every request's state (``request_state.py``, the decode table): the fabric's
completions, the messenger's messages, connections and losses, the engine's final outputs and
client cancels are queued to this worker as events and applied by its loop thread, in order.
No other thread changes a request's state; no network I/O runs on this loop (prefill endpoints
connect on their own threads). Failures (prefill lost, timeout, client gone) end the request with
a clear error of a known kind; its pages are freed once no late write can land in them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from backend.cluster.records import InstanceRecord
from backend.cluster.tracing import NO_SPAN, Span
from backend.disagg import auth
from backend.disagg.messenger import PrefillEndpoint
from backend.disagg.nixl_connector import NixlKVReceiver
from backend.disagg.protocol import CacheReport, Cancel, Message, PrefillFailed, PrefillRequest, PrefillStarted
from backend.engine.cache_summary import RECORD_MAX_KEYS, CacheSummary
from backend.engine.engine_loop import EngineLoop
from backend.engine.outputs import EngineOutput, ErrorKind
from backend.serving.config import InstanceConfig
from backend.serving.discovery import PrefillDirectory, register
from backend.serving.kv_router import KVRouter
from backend.serving.request_state import DecodeEvent, DecodeState, IllegalTransition, RequestState
from backend.serving.session import GenerationSession
from backend.serving.stats import DecodeStats
from backend.serving.worker import EngineDone, Responder, StopLoop, sampling_params, start_engine

log = logging.getLogger("triton_disagg.decode")
TICK_S = 0.05  # client cancels and deadlines are checked this often


# ---------------------------------------------------------------- events (queued to the loop)
@dataclass(frozen=True)
class Submitted:
    session: GenerationSession


@dataclass(frozen=True)
class ClientCancel:
    req_id: str


@dataclass(frozen=True)
class PagesReady:
    """Engine thread (KV loader): the request has its pages; ``remote``: its KV comes from elsewhere."""

    req_id: str
    page_table: list[int]
    cached_tokens: int
    remote: bool


@dataclass(frozen=True)
class KVDone:
    """Fabric thread: every write landed (``ok``), or the receive failed."""

    req_id: str
    ok: bool
    error: str | None
    meta: tuple[torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True)
class KVReleased:
    """Fabric thread: no write can land in the request's pages any more."""

    req_id: str


@dataclass(frozen=True)
class FromPrefill:
    endpoint: PrefillEndpoint
    message: Message


@dataclass(frozen=True)
class PrefillConnected:
    endpoint: PrefillEndpoint


@dataclass(frozen=True)
class PrefillLost:
    endpoint: PrefillEndpoint
    reason: str
    connection: int  # which of the endpoint's connections (a later one may be up already)


@dataclass(frozen=True)
class PrefillsChanged:
    """Membership (etcd watcher thread, or the fixed list at start): prefill instances that
    joined (or changed: ``draining``) and left."""

    joined: list[InstanceRecord]
    left: list[InstanceRecord]


Event = (
    Submitted
    | PrefillsChanged
    | ClientCancel
    | PagesReady
    | KVDone
    | KVReleased
    | FromPrefill
    | PrefillConnected
    | PrefillLost
    | EngineDone
    | StopLoop
)


@dataclass
class _Request:
    session: GenerationSession
    state: RequestState
    queued_until: float  # QUEUED: when waiting for pages turns into "overloaded"
    endpoint: PrefillEndpoint | None = None  # the prefill instance asked (None: none yet)
    pages: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    unsent_until: float = 0.0  # WAITING_KV before a prefill instance took it: until when to wait for one
    connection: int = 0  # the endpoint's connection (generation) the prefill request went on
    cancelled: bool = False  # by the client, or by this worker (page wait)
    tried: set[str] = field(default_factory=set)  # prefill instances whose KV load failed (recompute)
    kv_span: Span = NO_SPAN  # the KV transfer from the prefill instance asked (tracing)
    t_asked: float = 0.0  # when the prefill instance was asked (perf_counter)
    t_prefill_started: float = 0.0  # when it reported starting


class DecodeWorker:
    def __init__(self, config: InstanceConfig, name: str, model: str = ""):
        self.name = name
        # its name to prefill instances (messenger peer, NIXL agent): unique across the servers of
        # a deployment, where model instance names repeat
        self.peer_name = f"{name}-{uuid.uuid4().hex[:8]}"
        self.config = config
        if not config.membership.discovery:
            config.connector.endpoints()  # refuses a decode model without prefill instances
        self._secret = auth.load_secret(config.membership.deployment_secret_file)  # none: refuse to start
        self.engine = start_engine(config)
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.dims().vocab_size
        self.end_ids = tuple(self.engine.default_end_ids)
        self.receiver = NixlKVReceiver(
            self.engine, config.connector, self.peer_name, etcd_host=config.membership.etcd_host()
        )
        self.engine.set_kv_loader(self)
        self.loop = EngineLoop(self.engine, name=f"{name}-engine")
        self.responder = Responder(name)
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        # the prefill instances known (joined the membership); replaced, never changed in place,
        # by the loop thread, so other threads may read it
        self.endpoints: list[PrefillEndpoint] = []
        self._retired: set[str] = set()  # addresses that left or drain: no new requests, closed once idle
        # which record an address belongs to now: a prefill instance restarted at the same address
        # registers anew (another name) before the old record's lease has lapsed, and that old
        # record's leave must not retire the new instance's address (the loop thread's alone)
        self._owner: dict[str, str] = {}
        self.router = KVRouter(config.connector.kv_routing_weight)
        self.requests: dict[str, _Request] = {}  # the loop thread's alone
        self.counters = DecodeStats()
        dims = self.engine.dims()
        self.directory = PrefillDirectory(
            config, self._secret, dims, lambda joined, left: self._events.put(PrefillsChanged(joined, left))
        )
        self._published: tuple[CacheSummary, str] | None = None  # the last summary and its JSON
        self.registration = (
            register(config, self._secret, dims, "decode", model, state=self.published_state) if model else None
        )
        self._loop_thread = threading.Thread(target=self._run, name=f"{name}-decode-loop", daemon=True)
        self._loop_thread.start()

    def describe(self) -> str:
        c = self.config.engine
        return (
            f"decode on {c.torch_device}, KV pool {c.num_pages} pages x {c.page_size} tokens (HND), "
            f"prefill instances from {self.directory.source}, "
            f"KV timeout {self.config.connector.kv_transfer_timeout_s}s"
        )

    # ------------------------------------------------------------ serving-layer interface (any thread)
    def submit(self, session: GenerationSession) -> None:
        self._events.put(Submitted(session))

    def cancel(self, req_id: str) -> None:
        self._events.put(ClientCancel(req_id))

    # ------------------------------------------------------------ KV loader (engine thread)
    def load(self, req_id: str, token_ids: list[int], page_table: list[int], cached_tokens: int) -> bool:
        """The engine admitted ``req_id`` with its pages: True if a prefill instance computes the
        uncached part of the prompt (all tokens but the last), False if the engine does. Reads
        only; the loop thread acts on the queued ``PagesReady``."""
        n_remote = self.receiver.num_external_tokens(len(token_ids))
        r = self.requests.get(req_id)
        # the prompt's log-probabilities need the logits of every prompt position, which a prefill
        # instance does not send: such a request computes its prompt here
        scoring = r is not None and r.session.request.return_prompt_log_probs
        remote = cached_tokens < n_remote and not scoring and not self._prefill_here(n_remote - cached_tokens)
        self._events.put(PagesReady(req_id, list(page_table), cached_tokens, remote))
        return remote

    def _prefill_here(self, uncached_tokens: int) -> bool:
        """Conditional disaggregation (see ``ServingConfig``): short enough, or every prefill
        instance is busy past the bound."""
        serving = self.config.serving
        if uncached_tokens <= serving.local_prefill_max_tokens:
            return True
        bound = serving.local_prefill_queue_bound
        return bool(bound) and all(len(e.outstanding) >= bound for e in self.endpoints)

    # ------------------------------------------------------------ the loop
    def _run(self) -> None:
        next_tick = 0.0
        while True:
            try:
                event: Event | None = self._events.get(timeout=TICK_S)
            except queue.Empty:
                event = None
            if isinstance(event, StopLoop):
                return
            try:
                if event is not None:
                    self._handle(event)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + TICK_S
                    self._tick(now)
            except Exception:
                log.exception("decode loop: handling %s failed", type(event).__name__)

    def _handle(self, event: Event) -> None:
        match event:
            case Submitted(session):
                self._submitted(session)
            case PrefillsChanged(joined, left):
                self._prefills_changed(joined, left)
            case ClientCancel(req_id):
                self._cancel(req_id, None)
            case PagesReady(req_id, pages, cached, remote):
                self._pages_ready(req_id, pages, cached, remote)
            case KVDone(req_id, ok, error, meta):
                self._kv_done(req_id, ok, error, meta)
            case KVReleased(req_id):
                r = self._apply(req_id, DecodeEvent.KV_RELEASED)
                if r is not None and r.state.state is DecodeState.WAITING_KV:
                    self._load_again(r)
            case FromPrefill(endpoint, message):
                self._from_prefill(endpoint, message)
            case PrefillConnected(endpoint):
                log.info("decode %s: prefill instance %s connected", self.name, endpoint.address)
                self._send_unsent()
            case PrefillLost(endpoint, reason, connection):
                self._prefill_lost(endpoint, reason, connection)
            case EngineDone(output):
                self._engine_done(output)

    def _apply(self, req_id: str, event: DecodeEvent) -> _Request | None:
        """Advance ``req_id`` by ``event`` and run what the transition does; None (logged) for a
        request that is not here or an event its state does not allow."""
        r = self.requests.get(req_id)
        if r is None:
            log.debug("decode %s: %s for %s, which is not here (any more)", self.name, event.name, req_id)
            return None
        try:
            old = r.state.apply(event)
        except IllegalTransition as e:
            log.warning("decode %s: %s", self.name, e)
            return None
        new = r.state.state
        if new is DecodeState.FINISHED:
            r.kv_span.end(error="the request ended first")  # (ended already when its KV landed)
            del self.requests[req_id]
            if old is not DecodeState.RUNNING and old is not DecodeState.QUEUED:
                self.loop.release(req_id)  # it ended while waiting for KV: the engine kept its pages
        return r

    # ------------------------------------------------------------ transitions' work
    def _submitted(self, session: GenerationSession) -> None:
        down = self.engine.health()  # a tensor-parallel instance that lost a rank
        if down:
            session.fail(f"decode instance {self.name}: {down}", ErrorKind.OUT_OF_SERVICE)
            return
        serving = self.config.serving
        queued = sum(r.state.state is DecodeState.QUEUED for r in self.requests.values())
        if queued and queued >= serving.max_waiting_for_pages and not self._pool_fits(session):
            session.fail(
                f"decode KV pool is full and {serving.max_waiting_for_pages} requests are already waiting for pages",
                ErrorKind.OVERLOADED,
            )
            return
        req_id = session.req_id
        self.requests[req_id] = _Request(
            session, RequestState.decode(req_id), time.monotonic() + serving.page_wait_timeout_s
        )

        def on_output(out: EngineOutput) -> None:  # engine thread
            try:
                self.responder.deliver(session, out)
            finally:
                if out.finished:
                    self._events.put(EngineDone(out))

        self.loop.submit(req_id, session.prompt_ids, sampling_params(session, serving), on_output, remote_kv=True)

    def _pool_fits(self, session: GenerationSession) -> bool:
        """Whether the pool can commit the pages the request may grow into, now."""
        pool, page = self.engine.pool_stats(), self.config.engine.page_size
        tokens = min(len(session.prompt_ids) + session.request.remaining_tokens, self.max_model_len)
        return pool["total"] - pool["committed"] >= -(-tokens // page)

    def _pages_ready(self, req_id: str, pages: list[int], cached: int, remote: bool) -> None:
        r = self._apply(req_id, DecodeEvent.KV_NEEDED if remote else DecodeEvent.LOCAL)
        if r is None:
            return
        figures = r.session.figures
        figures.queue_s = time.perf_counter() - r.session.t_start
        figures.cached_tokens, figures.prefill = cached, "remote" if remote else "local"
        r.session.span.event(
            "pages",
            {
                "triton_disagg.pages": len(pages),
                "triton_disagg.cached_tokens": cached,
                "triton_disagg.kv_remote": remote,
            },
        )
        if not remote:
            self.counters.prefill_local_total += 1
            return
        r.pages, r.cached_tokens = pages, cached
        r.unsent_until = time.monotonic() + self.config.connector.prefill_connect_wait_s
        if r.cancelled:  # cancelled before it had pages (the engine ends it): nothing to ask for
            self._apply(req_id, DecodeEvent.NO_PREFILL)
            return
        self._ask_prefill(r)

    def _ask_prefill(self, r: _Request) -> None:
        """Send the prefill request to the cheapest connected prefill instance; with none
        connected, wait (``prefill_connect_wait_s``) for one to connect."""
        session = r.session
        n = len(session.prompt_ids)
        n_remote = self.receiver.num_external_tokens(n)
        endpoint = self._pick_endpoint(
            session.req_id,
            session.prompt_ids[:n_remote],
            n_remote - r.cached_tokens,
            exclude=r.tried,
            cache_salt=session.request.cache_salt,
        )
        if endpoint is None and r.tried:  # recomputing a failed load, and no other prefill instance is up
            self._compute_here(r)
            return
        if endpoint is None:
            for e in self.endpoints:
                e.wake()
            return  # retried when one connects, or failed at the deadline (_tick)
        assert endpoint.peer is not None and endpoint.layout is not None
        first_page = r.cached_tokens // self.config.engine.page_size
        req_id = session.req_id
        try:
            ticket = self.receiver.expect(
                req_id,
                n_remote,
                (endpoint.peer, endpoint.layout),
                on_ready=lambda rid, ok, err, meta: self._events.put(KVDone(rid, ok, err, meta)),
                on_release=lambda rid: self._events.put(KVReleased(rid)),
                first_page=first_page,
            )
        except (RuntimeError, ValueError) as e:  # e.g. every meta slot in use: retry later
            self.router.done(endpoint.address, req_id)
            if r.tried:
                self._compute_here(r)
                return
            self._cancel(req_id, f"cannot receive the KV now: {e}", ErrorKind.OVERLOADED)
            return
        r.endpoint, r.connection = endpoint, endpoint.generation
        endpoint.outstanding.add(req_id)
        self.counters.prefill_remote_total += 1
        r.t_asked = time.perf_counter()
        figures = session.figures
        figures.kv_pages, figures.kv_bytes = ticket.n_pages, self.receiver.bytes_of(ticket.n_pages)
        r.kv_span = session.span.child(
            "kv_transfer",
            {
                "triton_disagg.prefill_instance": endpoint.address,
                "triton_disagg.kv.pages": ticket.n_pages,
                "triton_disagg.kv.bytes": self.receiver.bytes_of(ticket.n_pages),
                "triton_disagg.kv.first_page": first_page,
                "triton_disagg.prompt_tokens": n_remote,
            },
            kind="client",
        )
        try:
            endpoint.send(
                PrefillRequest(
                    req_id,
                    ticket.generation,
                    ticket.slot,
                    session.prompt_ids[:n_remote],
                    r.pages[first_page : first_page + ticket.n_pages],
                    first_page,
                    session.request.cache_salt,
                    r.kv_span.traceparent(),
                )
            )
        except ConnectionError as e:
            self.receiver.cancel(req_id, f"sending to prefill instance {endpoint.address} failed: {e}")

    def _send_unsent(self) -> None:
        for r in list(self.requests.values()):
            if r.state.state is DecodeState.WAITING_KV and r.endpoint is None and not r.cancelled:
                self._ask_prefill(r)

    def _pick_endpoint(
        self, req_id: str, tokens: list[int], n_send: int, exclude: Collection[str] = (), cache_salt: str = ""
    ) -> PrefillEndpoint | None:
        """The connected prefill instance (not in ``exclude``) with the lowest routing cost for
        the prefill of ``tokens``; its ``n_send`` tokens (the part to send) count as queued there
        until the KV has arrived."""
        by_address = {
            e.address: e
            for e in self.endpoints
            if e.connected and e.address not in exclude and e.address not in self._retired
        }
        if not by_address:
            return None
        pages = -(-n_send // self.config.engine.page_size)
        picked = self.router.pick(req_id, tokens, list(by_address), pages, cache_salt)
        return by_address[picked] if picked is not None else None

    def _prefills_changed(self, joined: list[InstanceRecord], left: list[InstanceRecord]) -> None:
        """Connect to prefill instances that joined; stop sending to those that left or drain
        (their requests in flight finish, or are recomputed if their connection drops), and
        close them once nothing waits on them."""
        for record in joined:
            address = record.messenger
            known = any(e.address == address for e in self.endpoints)
            self._owner[address] = record.name
            if record.draining:
                self._retire(address, f"prefill instance {record.name} drains")
                continue
            if known:
                if address in self._retired:
                    log.info("decode %s: prefill instance %s (%s) serves again", self.name, record.name, address)
                self._retired.discard(address)
                continue
            host, _, port = address.rpartition(":")
            endpoint = PrefillEndpoint(
                host,
                int(port),
                self.receiver,
                self.peer_name,
                self._secret,
                lambda e, m: self._events.put(FromPrefill(e, m)),
                lambda e, r: self._events.put(PrefillLost(e, r, e.lost_generation)),
                on_connected=lambda e: self._events.put(PrefillConnected(e)),
            )
            self.endpoints = [*self.endpoints, endpoint]
            log.info("decode %s: prefill instance %s joined at %s; connecting", self.name, record.name, address)
            endpoint.start()
        for record in left:
            owner = self._owner.get(record.messenger)
            if owner is not None and owner != record.name:
                log.info(
                    "decode %s: prefill instance %s left the membership; %s serves at %s now",
                    self.name,
                    record.name,
                    owner,
                    record.messenger,
                )
                continue
            self._owner.pop(record.messenger, None)
            self._retire(record.messenger, f"prefill instance {record.name} left the membership")

    def _retire(self, address: str, why: str) -> None:
        if address in self._retired or not any(e.address == address for e in self.endpoints):
            return
        log.warning("decode %s: %s (%s): no new requests go there", self.name, why, address)
        self._retired.add(address)
        self._close_retired()

    def _close_retired(self) -> None:
        for e in self.endpoints:
            if e.address in self._retired and not e.outstanding:
                self.endpoints = [x for x in self.endpoints if x is not e]
                self._retired.discard(e.address)
                self.router.forget(e.address)
                threading.Thread(target=e.close, name=f"close-{e.address}", daemon=True).start()

    def _kv_done(self, req_id: str, ok: bool, error: str | None, meta) -> None:
        r = self.requests.get(req_id)
        if r is None:
            return
        if r.endpoint is not None:
            r.endpoint.outstanding.discard(req_id)
            self.router.done(r.endpoint.address, req_id)
        state = r.state.state
        r.kv_span.end(error=None if ok else (error or "the KV transfer failed"))
        if ok:
            now, figures = time.perf_counter(), r.session.figures
            figures.kv_wait_s = now - r.t_asked
            figures.kv_transfer_s = now - (r.t_prefill_started or r.t_asked)
            if self._apply(req_id, DecodeEvent.KV_LANDED) is not None and state is DecodeState.WAITING_KV:
                hidden, logits = meta if meta is not None else (None, None)
                self.loop.kv_loaded(req_id, hidden, logits)
            return
        if self._apply(req_id, DecodeEvent.KV_FAILED) is None or state is not DecodeState.WAITING_KV:
            return
        if r.cancelled or r.session.is_cancelled():
            self.loop.cancel(req_id)
            return
        address = r.endpoint.address if r.endpoint is not None else "?"
        message = f"KV transfer from prefill instance {address} failed: {error}"
        if self.config.serving.kv_load_failure_policy == "recompute":
            r.tried.add(address)
            r.session.figures.kv_load_failures = len(r.tried)
            failed = {"triton_disagg.prefill_instance": address, "exception.message": message}
            r.session.span.event("kv_load_failed", failed)
            self._apply(req_id, DecodeEvent.RECOMPUTE)
            self.counters.kv_loads_recomputed_total += 1
            log.warning(
                "decode %s: request %s: %s; it is computed again once no late write can land in its pages",
                self.name,
                req_id,
                message,
            )
            return
        self.loop.fail(req_id, message, ErrorKind.KV_TRANSFER_FAILED)

    def _load_again(self, r: _Request) -> None:
        """A failed load's pages are safe again: ask a prefill instance not tried yet, else
        compute the prompt here."""
        if r.cancelled or r.session.is_cancelled():
            self._cancel(r.session.req_id, None)
            return
        r.endpoint = None
        r.unsent_until = time.monotonic() + self.config.connector.prefill_connect_wait_s
        self._ask_prefill(r)

    def _compute_here(self, r: _Request) -> None:
        req_id = r.session.req_id
        if self._apply(req_id, DecodeEvent.LOCAL) is None:
            return
        log.warning("decode %s: request %s: computing its prompt here (tried %s)", self.name, req_id, sorted(r.tried))
        r.session.span.event("computed_here", {"triton_disagg.tried": sorted(r.tried)})
        r.session.figures.prefill = "local"
        self.counters.prefill_local_total += 1
        self.loop.compute_here(req_id)

    def _from_prefill(self, endpoint: PrefillEndpoint, msg: Message) -> None:
        if isinstance(msg, CacheReport):
            self.router.update(endpoint.address, msg.summary)
            return
        if not isinstance(msg, PrefillStarted | PrefillFailed):
            log.warning("unexpected %s from prefill instance %s", type(msg).__name__, endpoint.address)
            return
        r = self.requests.get(msg.req_id)
        if r is None or r.endpoint is not endpoint:
            return  # not a request of this connection (or one that ended)
        if isinstance(msg, PrefillStarted):
            r.kv_span.event("prefill_started")
            r.t_prefill_started = time.perf_counter()
            r.session.figures.prefill_queue_s = r.t_prefill_started - r.t_asked
            if self._apply(msg.req_id, DecodeEvent.PREFILL_STARTED) and r.state.state is DecodeState.WAITING_KV:
                self.receiver.started(msg.req_id, msg.generation)
            return
        if self._apply(msg.req_id, DecodeEvent.PREFILL_FAILED) and r.state.state is DecodeState.WAITING_KV:
            self.receiver.cancel(msg.req_id, f"prefill instance {endpoint.address}: {msg.message}")

    def _prefill_lost(self, endpoint: PrefillEndpoint, reason: str, connection: int) -> None:
        if endpoint.generation == connection:
            self.router.forget(endpoint.address)  # it may come back empty
        for req_id in list(endpoint.outstanding):
            r = self.requests.get(req_id)
            if r is None or r.connection != connection:
                continue  # sent on a newer connection
            if self._apply(req_id, DecodeEvent.PREFILL_FAILED) is not None:
                self.receiver.cancel(req_id, f"prefill instance {endpoint.address} lost ({reason})")

    def _engine_done(self, out: EngineOutput) -> None:
        r = self.requests.get(out.req_id)
        if r is None:
            return
        state = r.state.state
        if state is DecodeState.WAITING_KV and r.endpoint is None:  # nothing asked yet: nothing can land
            self._apply(out.req_id, DecodeEvent.NO_PREFILL)
            return
        self._apply(out.req_id, DecodeEvent.ENGINE_FINISHED)
        if state is DecodeState.WAITING_KV:  # the engine ended it (shut down, failed step)
            self._stop_prefill(r, out.error or "the decode engine ended the request")
        elif state is DecodeState.RUNNING and out.pages_held:
            # the engine ended it while it waited for KV that then landed whole (its KVLoaded came
            # too late): nothing more can be written, so its pages go back now
            self.loop.release(out.req_id)

    def _cancel(self, req_id: str, reason: str | None, kind: ErrorKind = ErrorKind.OVERLOADED) -> None:
        """End a request for the client (``reason`` None) or with an error of ``kind``."""
        r = self.requests.get(req_id)
        if r is None or r.cancelled:
            return
        r.cancelled = True
        state = r.state.state
        if state is DecodeState.WAITING_KV and r.endpoint is None:  # no prefill instance was asked
            self._end_in_engine(req_id, reason, kind)
            self._apply(req_id, DecodeEvent.NO_PREFILL)
            return
        if self._apply(req_id, DecodeEvent.CANCEL) is None:
            return
        if state is DecodeState.WAITING_KV:
            if reason is None:
                log.info("request %s cancelled by the client while its prefill runs", req_id)
            self._stop_prefill(r, reason or "cancelled by client")
        self._end_in_engine(req_id, reason, kind)

    def _end_in_engine(self, req_id: str, reason: str | None, kind: ErrorKind) -> None:
        if reason is None:
            self.loop.cancel(req_id)
        else:
            self.loop.fail(req_id, reason, kind)

    def _stop_prefill(self, r: _Request, reason: str) -> None:
        """Tell the prefill instance to stop and the receiver to stop waiting (KV_FAILED follows,
        then KV_RELEASED once no write can land)."""
        req_id = r.session.req_id
        if r.endpoint is not None:
            try:
                r.endpoint.send(Cancel(req_id))
            except ConnectionError:
                pass
        self.receiver.cancel(req_id, reason)

    def _tick(self, now: float) -> None:
        """Client cancels (polled: a waiting request sends nothing that would notice), requests
        waiting too long for pages or for a prefill instance to connect."""
        unsent = False
        for req_id, r in list(self.requests.items()):
            state = r.state.state
            if r.cancelled or state is DecodeState.RUNNING or r.state.finished:
                continue
            unsent = unsent or (state is DecodeState.WAITING_KV and r.endpoint is None)
            if r.session.is_cancelled():
                self._cancel(req_id, None)
            elif state is DecodeState.QUEUED and now >= r.queued_until:
                self._cancel(
                    req_id,
                    f"no KV pages free on the decode instance within {self.config.serving.page_wait_timeout_s:.0f}s"
                    " (page_wait_timeout_s)",
                    ErrorKind.OVERLOADED,
                )
            elif state is DecodeState.WAITING_KV and r.endpoint is None and now >= r.unsent_until:
                self._cancel(
                    req_id, f"no prefill instance reachable ({self._endpoint_errors()})", ErrorKind.PREFILL_UNAVAILABLE
                )
        if unsent and any(e.connected for e in self.endpoints):
            self._send_unsent()  # one connected meanwhile
        if self._retired:
            self._close_retired()

    # ------------------------------------------------------------ serving-layer interface
    def on_out_of_service(self, callback: Callable[[str], None]) -> None:
        self.engine.on_out_of_service(callback)

    def health(self) -> str | None:
        down = self.engine.health()
        if down:
            return f"decode instance {self.name}: {down}"
        if not any(e.connected and e.address not in self._retired for e in self.endpoints):
            return f"decode instance {self.name}: no prefill instance connected ({self._endpoint_errors()})"
        return None

    def cache_summary(self) -> CacheSummary:
        waiting = sum(r.state.state is DecodeState.WAITING_KV for r in list(self.requests.values()))
        return dataclasses.replace(self.engine.cache_summary(), waiting=waiting)

    def published_state(self) -> dict[str, str]:
        """What routers read in this instance's membership record: why it cannot serve ("": it
        can) and its cache summary (JSON, at most ``RECORD_MAX_KEYS`` keys; encoded again only
        when the summary changed: this is asked ten times a second)."""
        summary = self.cache_summary()
        if self._published is None or self._published[0] != summary:
            wire = summary.to_json(max_keys=RECORD_MAX_KEYS)
            self._published = (summary, json.dumps(wire, separators=(",", ":")))
        return {"health": self.health() or "", "cache": self._published[1]}

    def _endpoint_errors(self) -> str:
        endpoints = self.endpoints
        if not endpoints:
            return f"none known yet, from {self.directory.source}"
        return "; ".join(f"{e.address}: {e.last_error}" for e in endpoints)

    def stats(self) -> DecodeStats:
        s = dataclasses.replace(self.counters)
        s.set_pool(self.engine.pool_stats())
        s.requests_waiting_kv = sum(
            r.state.state in (DecodeState.QUEUED, DecodeState.WAITING_KV) for r in list(self.requests.values())
        )
        s.prefill_endpoints_connected = sum(e.connected for e in self.endpoints)
        s.update(self.receiver.stats())
        return s

    def observations(self) -> dict[str, list[float]]:
        return self.receiver.observations()

    def in_flight(self) -> int:
        return len(self.requests)

    def leave(self, final: bool) -> None:
        if self.registration is None:
            return
        if final:
            self.registration.close()
        elif not self.registration.record.draining:
            self.registration.update(draining=True)

    def member_name(self) -> str | None:
        return self.registration.record.name if self.registration is not None else None

    def shutdown(self) -> None:
        if self.registration is not None:
            self.registration.close()  # deregister first: routers stop sending here
        self.directory.close()
        for e in self.endpoints:
            e.close()
        self.loop.shutdown()
        self.responder.close()
        self._events.put(StopLoop())
        self._loop_thread.join(timeout=5)
        self.receiver.close()
        self.engine.close()
