"""Prefill worker: runs prompts (all tokens but the last) for decode instances and never samples.

Requests arrive over the KV messenger (``backend/disagg/messenger.py``) with the destination
pages; a request belongs to the connection that sent it (a cancel from another connection is
ignored). The worker admits each into the KV sender (``backend/disagg/nixl_connector.py``),
which streams the pages layer by layer while the engine runs the request as a prefill-only
request in its continuous batches; when the sender says the pages may be freed, they are.
A tensor-parallel instance that loses a rank fails every request and stops listening, so
decode instances route elsewhere. Every ``cache_report_interval_s`` the worker reports its prefix
cache and load to every connected decode instance (``CacheReport``) when they changed, or when a
decode instance connected since the last report, and at least every ``REPORT_REFRESH_S``; the
decode instances route by it (``backend/serving/kv_router.py``).

One loop owns every request's state (``request_state.py``, the prefill table): messages and lost
connections (messenger threads), the sender's start, error and freeable reports (engine and fabric
threads), the engine's final outputs and losing a TP rank are queued to this worker as events and
applied by its loop thread, in order; the cache reports go out from that loop too.

With tracing on (``otlp_endpoint``), each request is a ``prefill`` span, the child of the decode
instance's KV transfer span (the request's ``traceparent``), with events when its first chunk is
scheduled (``started``), at each chunk (``chunk``) and each layer's writes posted
(``kv_layer_sent``, from the sender's threads), when its prompt is computed, and when its last
page is written (``kv_sent``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from backend.cluster.tracing import NO_SPAN, Span, start_tracing
from backend.disagg import auth
from backend.disagg.connector import SendRequest
from backend.disagg.messenger import Connection, MessengerServer
from backend.disagg.nixl_connector import NixlKVSender
from backend.disagg.protocol import CacheReport, Cancel, Message, PrefillFailed, PrefillRequest, PrefillStarted
from backend.engine.cache_summary import CacheSummary
from backend.engine.engine_loop import EngineLoop
from backend.engine.outputs import EngineOutput, ErrorKind, FinishReason
from backend.engine.sampling_params import SamplingParams
from backend.serving.config import InstanceConfig
from backend.serving.discovery import register
from backend.serving.request_state import IllegalTransition, PrefillEvent, PrefillState, RequestState
from backend.serving.stats import PrefillStats
from backend.serving.worker import EngineDone, StopLoop, start_engine

log = logging.getLogger("triton_disagg.prefill")
REPORT_REFRESH_S = 5.0
MAX_REPORT_KEYS = 262144  # 2 MiB of keys, 2.7 MiB of base64: within a messenger frame


# ---------------------------------------------------------------- events (queued to the loop)
@dataclass(frozen=True)
class Received:
    """Messenger thread: a message from a decode instance, on the connection it came on."""

    peer: str
    message: Message
    conn: Connection


@dataclass(frozen=True)
class PeerLost:
    peer: str
    reason: str


@dataclass(frozen=True)
class Started:
    """Engine thread (the sender's step hook): the request's first chunk is scheduled."""

    req_id: str
    generation: int


@dataclass(frozen=True)
class SendError:
    """Fabric thread: a transfer of the request failed."""

    req_id: str
    reason: str


@dataclass(frozen=True)
class Freeable:
    """Fabric thread: no write reads the request's pages any more."""

    req_id: str


@dataclass(frozen=True)
class OutOfService:
    """The instance lost a TP rank; ``told`` is set once the decode instances were told why."""

    reason: str
    told: threading.Event


Event = Received | PeerLost | Started | SendError | EngineDone | Freeable | OutOfService | StopLoop


@dataclass
class _Request:
    state: RequestState
    conn: Connection
    peer: str
    span: Span = NO_SPAN


class PrefillWorker:
    def __init__(self, config: InstanceConfig, name: str, model: str = ""):
        self.name = name
        self.config = config
        secret = auth.load_secret(config.membership.deployment_secret_file)  # none: refuse to start
        self.engine = start_engine(config)
        self.vocab_size = self.engine.dims().vocab_size
        self.max_model_len = self.engine.max_model_len
        self.requests: dict[str, _Request] = {}  # the loop thread's alone
        self.tracer = start_tracing(config.membership.otlp_endpoint, "prefill", name)
        self._spans: dict[str, Span] = {}  # request -> its span, for the sender's threads (tracing)
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.sender = NixlKVSender(
            self.engine,
            config.connector,
            name,
            lambda req_id, reason: self._events.put(SendError(req_id, reason)),
            lambda request: self._events.put(Started(request.req_id, request.generation)),
            etcd_host=config.membership.etcd_host(),
            on_progress=self._progress if self.tracer.enabled else None,
        )
        self.loop = EngineLoop(self.engine, name=f"{name}-engine")
        c = config.connector
        self.server = MessengerServer(
            self.sender,
            c.messenger_host,
            c.messenger_port,
            lambda peer, msg, conn: self._events.put(Received(peer, msg, conn)),
            lambda peer, reason: self._events.put(PeerLost(peer, reason)),
            name,
            secret,
            max_connections=c.messenger_max_connections,
            handshake_timeout_s=c.messenger_handshake_timeout_s,
        )
        self.engine.on_out_of_service(self._on_out_of_service)
        advertise = c.messenger_advertise or c.messenger_host
        self.registration = register(
            config, secret, self.engine.dims(), "prefill", model or name, messenger=f"{advertise}:{self.server.port}"
        )
        self._last_report: tuple | None = None
        self._last_report_at, self._last_conns = 0.0, 0
        self._loop_thread = threading.Thread(target=self._run, name=f"{name}-prefill-loop", daemon=True)
        self._loop_thread.start()

    def describe(self) -> str:
        c = self.config.engine
        return (
            f"prefill on {c.torch_device}, KV pool {c.num_pages} pages x {c.page_size} tokens (HND), "
            f"messenger {self.server.host}:{self.server.port}, "
            f"{'layer-wise streaming' if self.config.connector.stream_layers else 'send after prefill'}"
        )

    # ------------------------------------------------------------ the loop
    def _run(self) -> None:
        period = self.config.connector.cache_report_interval_s
        next_report = time.monotonic() + period
        while True:
            try:
                event: Event | None = self._events.get(timeout=max(0.0, next_report - time.monotonic()))
            except queue.Empty:
                event = None
            if isinstance(event, StopLoop):
                return
            try:
                if event is not None:
                    self._handle(event)
                if time.monotonic() >= next_report:
                    next_report = time.monotonic() + period
                    self._report()
            except Exception:
                log.exception("prefill loop: handling %s failed", type(event).__name__)

    def _handle(self, event: Event) -> None:
        match event:
            case Received(peer, message, conn):
                self._received(peer, message, conn)
            case PeerLost(peer, reason):
                lost = [req_id for req_id, r in self.requests.items() if r.peer == peer]
                log.warning("decode instance %s lost (%s); cancelling %d prefill(s)", peer, reason, len(lost))
                for req_id in lost:
                    self._cancel(req_id, f"decode instance lost: {reason}")
            case Started(req_id, generation):
                r = self._apply(req_id, PrefillEvent.STARTED)
                if r is not None:
                    r.span.event("started")
                    self._send(r.conn, PrefillStarted(req_id, generation))
            case SendError(req_id, reason):
                log.warning("prefill %s: transfer error %s", req_id, reason)
                failed = self.requests.get(req_id)
                if failed is not None:
                    failed.span.end(error=f"transfer error: {reason}")
                if self._apply(req_id, PrefillEvent.CANCEL) is not None:
                    self.loop.cancel(req_id)
            case EngineDone(output):
                self._engine_done(output)
            case Freeable(req_id):
                sent = self.requests.get(req_id)
                if sent is not None:
                    sent.span.event("kv_sent")
                self._apply(req_id, PrefillEvent.FREEABLE)
            case OutOfService(reason, told):
                try:
                    self._out_of_service(reason)
                finally:
                    told.set()

    def _apply(self, req_id: str, event: PrefillEvent) -> _Request | None:
        r = self.requests.get(req_id)
        if r is None:
            log.debug("prefill %s: %s for %s, which is not here (any more)", self.name, event.name, req_id)
            return None
        try:
            r.state.apply(event)
        except IllegalTransition as e:
            log.warning("prefill %s: %s", self.name, e)
            return None
        if r.state.state is PrefillState.FINISHED:
            r.span.end()  # (with an error, ended already where it failed)
            self._spans.pop(req_id, None)
            del self.requests[req_id]
            self.loop.release(req_id)
        return r

    # ------------------------------------------------------------ transitions' work
    def _received(self, peer: str, msg: Message, conn: Connection) -> None:
        if isinstance(msg, PrefillRequest):
            self._start(peer, msg, conn)
        elif isinstance(msg, Cancel):
            r = self.requests.get(msg.req_id)
            if r is not None and r.conn is conn:
                self._cancel(msg.req_id, "cancelled by decode instance")
            else:
                log.warning("ignored a cancel of %s from %s: not its request", msg.req_id, peer)
        else:
            log.warning("unexpected %s from decode instance %s", type(msg).__name__, peer)

    def _start(self, peer: str, msg: PrefillRequest, conn: Connection) -> None:
        down = self.engine.health()
        request = SendRequest(
            msg.req_id, peer, msg.generation, msg.slot, len(msg.tokens), msg.dst_pages, msg.first_page
        )
        try:
            if down:
                raise ValueError(down)
            self._check(msg)
            self.sender.add_request(request)
        except ValueError as e:
            kind = ErrorKind.OUT_OF_SERVICE if down else ErrorKind.BAD_REQUEST
            log.warning("refused prefill %s from %s (%s): %s", msg.req_id, peer, kind, e)
            self._send(conn, PrefillFailed(msg.req_id, kind, str(e)))
            self.tracer.span("prefill", msg.traceparent).end(error=f"{kind}: {e}")
            return
        span = self.tracer.span(
            "prefill",
            msg.traceparent,
            {
                "triton_disagg.request_id": msg.req_id,
                "triton_disagg.decode_instance": peer,
                "triton_disagg.prompt_tokens": len(msg.tokens),
                "triton_disagg.kv.first_page": msg.first_page,
                "triton_disagg.kv.pages": len(msg.dst_pages),
            },
        )
        self.requests[msg.req_id] = _Request(RequestState.prefill(msg.req_id), conn, peer, span)
        if self.tracer.enabled:
            self._spans[msg.req_id] = span
        log.debug("prefill %s: %d tokens -> %d pages of %s", msg.req_id, len(msg.tokens), len(msg.dst_pages), peer)
        params = SamplingParams(max_tokens=1, cache_salt=msg.cache_salt)
        self.loop.submit(msg.req_id, msg.tokens, params, self._on_output, prefill_only=True)

    def _check(self, msg: PrefillRequest) -> None:
        """Tokens within this engine's limits, before anything reaches the engine: a bad request
        fails alone (here or, for its destination pages, in the sender), never the batch it would
        have joined."""
        if not 0 < len(msg.tokens) < self.max_model_len:
            raise ValueError(f"{len(msg.tokens)} tokens: must be 1..{self.max_model_len - 1}")
        if max(msg.tokens) >= self.vocab_size:
            raise ValueError(f"token id {max(msg.tokens)} is outside the vocabulary of {self.vocab_size}")

    def _cancel(self, req_id: str, reason: str) -> None:
        r = self.requests.get(req_id)
        if r is not None:
            r.span.end(error=reason)
        if self._apply(req_id, PrefillEvent.CANCEL) is not None:
            self.loop.cancel(req_id)
            self.sender.cancel(req_id, reason)

    def _engine_done(self, out: EngineOutput) -> None:
        r = self.requests.get(out.req_id)
        if r is not None:
            if out.finish_reason == FinishReason.ERROR:
                r.span.end(error=out.error or "prefill failed")
            else:
                r.span.event("computed", {"gen_ai.usage.input_tokens": out.num_prompt_tokens})
        r = self._apply(out.req_id, PrefillEvent.ENGINE_FINISHED)
        if r is not None and out.finish_reason == FinishReason.ERROR:
            kind = out.error_kind or ErrorKind.ENGINE
            self._send(r.conn, PrefillFailed(out.req_id, kind, out.error or "prefill failed"))

    def _out_of_service(self, reason: str) -> None:
        """Fail every request with ``reason`` and stop listening, so decode instances route elsewhere.
        The reasons go out on the messenger before the requests are stopped here, so a decode
        instance hears why before its receive sees the sender stop."""
        log.error("prefill %s out of service: %s; failing %d request(s)", self.name, reason, len(self.requests))
        for req_id, r in list(self.requests.items()):
            r.span.end(error=reason)
            self._send(r.conn, PrefillFailed(req_id, ErrorKind.OUT_OF_SERVICE, reason))
        self.server.close()

    def _on_out_of_service(self, reason: str) -> None:
        """TP watcher or engine thread (the engine fails the requests only after this returns): wait
        until the loop has told every decode instance why, so that reason reaches them before their
        receives see the senders stop."""
        told = threading.Event()
        self._events.put(OutOfService(reason, told))
        if not told.wait(timeout=5.0):
            log.error("prefill %s: the loop did not report the loss of service within 5 s", self.name)

    def _progress(self, req_id: str, what: str, figures: dict) -> None:
        """The sender's threads: a chunk scheduled, a layer's writes posted (span events)."""
        span = self._spans.get(req_id)
        if span is not None:
            span.event(what, figures)

    @staticmethod
    def _send(conn: Connection, msg: Message) -> None:
        try:
            conn.send(msg)
        except ConnectionError:
            pass

    # ------------------------------------------------------------ engine outputs (engine thread)
    def _on_output(self, out: EngineOutput) -> None:
        if not out.finished:
            return
        self._events.put(EngineDone(out))  # before the sender can report it freeable
        self.sender.request_finished(out, lambda req_id, ok, err: self._events.put(Freeable(req_id)))

    # ------------------------------------------------------------ cache reports (the loop)
    def _report(self) -> None:
        conns = self.server.connections()
        summary = self.cache_summary()
        if len(summary.keys) > MAX_REPORT_KEYS:
            summary = dataclasses.replace(summary, keys=frozenset(itertools.islice(summary.keys, MAX_REPORT_KEYS)))
        now = time.monotonic()
        state = (summary.version, summary.free_pages, summary.running, summary.waiting)
        if state != self._last_report or conns > self._last_conns or now - self._last_report_at >= REPORT_REFRESH_S:
            self.server.broadcast(CacheReport(summary))
            self._last_report, self._last_report_at = state, now
        self._last_conns = conns

    # ------------------------------------------------------------ serving-layer interface
    def observations(self) -> dict[str, list[float]]:
        return {}  # the decode instances measure queue and transfer times per request

    def stats(self) -> PrefillStats:
        s = PrefillStats()
        s.set_pool(self.engine.pool_stats())
        s.update(self.sender.stats())
        s.trace_spans_dropped_total = self.tracer.stats()["spans_dropped"]
        return s

    def on_out_of_service(self, callback: Callable[[str], None]) -> None:
        self.engine.on_out_of_service(callback)

    def health(self) -> str | None:
        down = self.engine.health()
        return f"prefill instance {self.name}: {down}" if down else None

    def cache_summary(self) -> CacheSummary:
        return dataclasses.replace(self.engine.cache_summary(), waiting=len(self.requests))

    def in_flight(self) -> int:
        return len(self.requests)

    def leave(self, final: bool) -> None:
        """``final`` False: mark this instance draining in the membership (decode instances send
        it nothing new); True: leave it."""
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
            self.registration.close()  # deregister first: decode instances stop sending here
        self.server.close()
        self.loop.shutdown()
        self._events.put(StopLoop())
        self._loop_thread.join(timeout=5)
        self.sender.close()
        self.engine.close()
        self.tracer.close()
