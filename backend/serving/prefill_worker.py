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
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time

from backend.disagg import auth
from backend.disagg.connector import SendRequest
from backend.disagg.messenger import Connection, MessengerServer
from backend.disagg.nixl_connector import NixlKVSender
from backend.disagg.protocol import CacheReport, Cancel, Message, PrefillFailed, PrefillRequest, PrefillStarted
from backend.engine.engine_loop import EngineLoop
from backend.engine.outputs import EngineOutput, ErrorKind, FinishReason
from backend.engine.sampling_params import SamplingParams
from backend.serving.config import InstanceConfig
from backend.serving.worker import pool_gauges, start_engine

log = logging.getLogger("triton_disagg.prefill")
REPORT_REFRESH_S = 5.0
MAX_REPORT_KEYS = 262144  # 2 MiB of keys, 2.7 MiB of base64: within a messenger frame


class PrefillWorker:
    def __init__(self, config: InstanceConfig, name: str):
        self.name = name
        self.config = config
        secret = auth.load_secret(config.connector.messenger_secret_file)  # none: refuse to start
        self.engine = start_engine(config)
        self.vocab_size = self.engine.dims().vocab_size
        self.max_model_len = self.engine.max_model_len
        self._owners: dict[str, Connection] = {}  # req_id -> the connection that asked for it
        self._lock = threading.Lock()
        self.server: MessengerServer | None = None
        self.sender = NixlKVSender(self.engine, config.connector, name, self._on_send_error, self._on_started)
        self.loop = EngineLoop(self.engine, name=f"{name}-engine")
        c = config.connector
        self.server = MessengerServer(
            self.sender,
            c.messenger_host,
            c.messenger_port,
            self._on_message,
            self._on_peer_lost,
            name,
            secret,
            max_connections=c.messenger_max_connections,
            handshake_timeout_s=c.messenger_handshake_timeout_s,
        )
        self.engine.on_out_of_service(self._out_of_service)
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, name=f"{name}-cache-report", daemon=True)
        self._reporter.start()

    def describe(self) -> str:
        c = self.config.engine
        return (
            f"prefill on {c.torch_device}, KV pool {c.num_pages} pages x {c.page_size} tokens (HND), "
            f"messenger {self.server.host}:{self.server.port}, "
            f"{'layer-wise streaming' if self.config.connector.stream_layers else 'send after prefill'}"
        )

    # ------------------------------------------------------------ messenger (network threads)
    def _on_message(self, peer: str, msg: Message, conn: Connection) -> None:
        if isinstance(msg, PrefillRequest):
            self._start(peer, msg, conn)
        elif isinstance(msg, Cancel):
            with self._lock:
                owner = self._owners.get(msg.req_id)
            if owner is conn:
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
            return
        with self._lock:
            self._owners[msg.req_id] = conn
        log.debug("prefill %s: %d tokens -> %d pages of %s", msg.req_id, len(msg.tokens), len(msg.dst_pages), peer)
        self.loop.submit(msg.req_id, msg.tokens, SamplingParams(max_tokens=1), self._on_output, prefill_only=True)

    def _check(self, msg: PrefillRequest) -> None:
        """Tokens within this engine's limits, before anything reaches the engine: a bad request
        fails alone (here or, for its destination pages, in the sender), never the batch it would
        have joined."""
        if not 0 < len(msg.tokens) < self.max_model_len:
            raise ValueError(f"{len(msg.tokens)} tokens: must be 1..{self.max_model_len - 1}")
        if max(msg.tokens) >= self.vocab_size:
            raise ValueError(f"token id {max(msg.tokens)} is outside the vocabulary of {self.vocab_size}")

    def _cancel(self, req_id: str, reason: str) -> None:
        if self.sender.has(req_id):
            self.loop.cancel(req_id)
            self.sender.cancel(req_id, reason)

    def _on_peer_lost(self, peer: str, reason: str) -> None:
        lost = self.sender.requests_of(peer)
        log.warning("decode instance %s lost (%s); cancelling %d prefill(s)", peer, reason, len(lost))
        for req_id in lost:
            self._cancel(req_id, f"decode instance lost: {reason}")

    @staticmethod
    def _send(conn: Connection, msg: Message) -> None:
        try:
            conn.send(msg)
        except ConnectionError:
            pass

    # ------------------------------------------------------------ engine outputs (loop thread)
    def _on_output(self, out: EngineOutput) -> None:
        if not out.finished:
            return
        if out.finish_reason == FinishReason.ERROR:
            with self._lock:
                conn = self._owners.get(out.req_id)
            if conn is not None:
                self._send(
                    conn, PrefillFailed(out.req_id, out.error_kind or ErrorKind.ENGINE, out.error or "prefill failed")
                )
        self.sender.request_finished(out, self._on_freeable)

    def _on_freeable(self, req_id: str, ok: bool, err: str | None) -> None:
        """Every write of the request is done (or it failed and nothing is in flight)."""
        with self._lock:
            self._owners.pop(req_id, None)
        freed = self.loop.release(req_id)
        log.debug("prefill %s: %d pages freed", req_id, freed)

    def _on_started(self, request: SendRequest) -> None:
        """Engine thread: the request's first chunk is scheduled; its receiver's deadline restarts."""
        with self._lock:
            conn = self._owners.get(request.req_id)
        if conn is not None:
            self._send(conn, PrefillStarted(request.req_id, request.generation))

    def _on_send_error(self, req_id: str, err: str) -> None:
        self.loop.cancel(req_id)

    def _out_of_service(self, reason: str) -> None:
        """Fail every request with ``reason`` and stop listening, so decode instances route elsewhere."""
        with self._lock:
            owners = list(self._owners.items())
        for req_id, conn in owners:
            self._send(conn, PrefillFailed(req_id, ErrorKind.OUT_OF_SERVICE, reason))
        if owners:  # let the reasons land before the engine fails the jobs (their "sender stopped" races them)
            time.sleep(0.5)
        self.server.close()

    # ------------------------------------------------------------ cache reports (own thread)
    def _report_loop(self) -> None:
        last, last_at, last_conns = None, 0.0, 0  # last: what the last report said (keys by version)
        while not self._stop.wait(self.config.connector.cache_report_interval_s):
            try:
                conns = self.server.connections()
                summary = self.engine.cache_summary()
                with self._lock:
                    summary = dataclasses.replace(summary, waiting=len(self._owners))
                if len(summary.keys) > MAX_REPORT_KEYS:
                    summary = dataclasses.replace(
                        summary, keys=frozenset(itertools.islice(summary.keys, MAX_REPORT_KEYS))
                    )
                now = time.monotonic()
                state = (summary.version, summary.free_pages, summary.running, summary.waiting)
                if state != last or conns > last_conns or now - last_at >= REPORT_REFRESH_S:
                    self.server.broadcast(CacheReport(summary))
                    last, last_at = state, now
                last_conns = conns
            except Exception:
                log.exception("cache report failed")

    # ------------------------------------------------------------ serving-layer interface
    def observations(self) -> dict[str, list[float]]:
        return {}  # the decode instances measure queue and transfer times per request

    def stats(self) -> dict:
        return {**pool_gauges(self.engine.pool_stats()), **self.sender.stats()}

    def shutdown(self) -> None:
        self._stop.set()
        self.server.close()
        self.loop.shutdown()
        self.sender.close()
        self.engine.close()
