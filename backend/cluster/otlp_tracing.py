"""Tracing on: this process's spans, exported over OTLP/HTTP (protobuf) to the collector with
the OpenTelemetry SDK (``tracing.py`` is the interface, and tracing off).

Spans wait for export in a bounded queue (``MAX_QUEUE``) that the SDK's batch processor's one
thread empties, each export bounded by ``EXPORT_TIMEOUT_S``: an unreachable or slow collector
never slows serving. A span that finds the queue full, or whose export failed, is dropped and
counted (:meth:`Tracing.stats`; logged once).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("triton_disagg.tracing")

MAX_QUEUE = 2048  # spans waiting for export at most; more are dropped (counted)
EXPORT_TIMEOUT_S = 2.0  # one export to the collector at most
EXPORT_EVERY_S = 5.0  # spans go out in batches this often (or when a batch is full): the SDK's default
KINDS = {
    "server": SpanKind.SERVER,
    "client": SpanKind.CLIENT,
    "internal": SpanKind.INTERNAL,
    "consumer": SpanKind.CONSUMER,
    "producer": SpanKind.PRODUCER,
}


Attributes = dict[str, Any]


class _Recording:
    """A span that records (``tracing.Span``)."""

    def __init__(self, tracing: Tracing, span: Any):
        self._tracing, self._span = tracing, span
        self._ended = False

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        self._span.add_event(name, attributes=attributes or {})

    def set(self, attributes: Attributes) -> None:
        self._span.set_attributes(attributes)

    def child(self, name: str, attributes: Attributes | None = None, kind: str = "internal") -> _Recording:
        context = trace.set_span_in_context(self._span)
        return self._tracing._start(name, context, attributes, kind)

    def traceparent(self) -> str:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(self._span))
        return carrier.get("traceparent", "")

    def end(self, error: str | None = None, at_ns: int | None = None) -> None:
        if self._ended:  # the first end counts (a request can end by several paths)
            return
        self._ended = True
        if error:
            self._span.set_status(Status(StatusCode.ERROR, error[:512]))
        self._span.end(end_time=at_ns)


class Tracing:
    """Spans of this process, exported to ``endpoint`` (``http://HOST:PORT``) as ``service``
    (its role) and ``instance`` (this process's name in the deployment)."""

    enabled = True

    def __init__(self, endpoint: str, service: str, instance: str):
        self.endpoint = endpoint.rstrip("/")
        self._lock = threading.Lock()
        self._counts = {"spans_ended": 0, "spans_exported": 0, "spans_dropped": 0}
        self._queued = 0
        self._warned_malformed = False
        self._warned_export = False
        otlp = OTLPSpanExporter(endpoint=f"{self.endpoint}/v1/traces", timeout=EXPORT_TIMEOUT_S)
        exporter = _CountingExporter(otlp, self)
        resource = Resource.create({"service.name": f"triton-disagg-{service}", "service.instance.id": instance})
        self._provider = TracerProvider(resource=resource)
        # the SDK's queue is larger than ours, so it never drops a span we did not count
        batch = BatchSpanProcessor(
            exporter,
            max_queue_size=2 * MAX_QUEUE,
            max_export_batch_size=min(512, MAX_QUEUE),
            schedule_delay_millis=EXPORT_EVERY_S * 1000,
            export_timeout_millis=EXPORT_TIMEOUT_S * 1000,
        )
        self._provider.add_span_processor(_Bounded(batch, self))
        self._tracer = self._provider.get_tracer("triton_disagg")
        log.info("tracing: spans of %s %s go to %s/v1/traces (OTLP/HTTP)", service, instance, self.endpoint)

    def span(
        self, name: str, traceparent: str = "", attributes: Attributes | None = None, kind: str = "server"
    ) -> _Recording:
        """A new span, the child of ``traceparent`` (a W3C header value; "" or malformed: a new
        trace)."""
        return self._start(name, self._parent(traceparent), attributes, kind)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"spans_ended": self._counts["spans_ended"], "spans_dropped": self._counts["spans_dropped"]}

    def close(self) -> None:
        """Export what is queued (bounded), then stop."""
        try:
            self._provider.shutdown()
        except Exception as e:  # never fail a shutdown for traces
            log.debug("tracing shutdown: %s", e)

    # ---------------------------------------------------------------- internals
    def _start(self, name: str, context: Any, attributes: Attributes | None, kind: str) -> _Recording:
        span = self._tracer.start_span(name, context=context, kind=KINDS[kind], attributes=attributes or {})
        return _Recording(self, span)

    def _parent(self, traceparent: str) -> Any:
        if not traceparent:
            return None
        context = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
        if not trace.get_current_span(context).get_span_context().is_valid:
            with self._lock:
                warn, self._warned_malformed = not self._warned_malformed, True
            if warn:
                log.warning("tracing: malformed traceparent %r: the request starts a new trace", traceparent[:80])
            return None
        return context

    def _admit(self) -> bool:
        """A span ended: whether it may wait for export (False: the queue is full, dropped)."""
        with self._lock:
            self._counts["spans_ended"] += 1
            if self._queued >= MAX_QUEUE:
                self._counts["spans_dropped"] += 1
                return False
            self._queued += 1
            return True

    def _exported(self, n: int, ok: bool) -> None:
        with self._lock:
            self._queued -= n
            self._counts["spans_exported" if ok else "spans_dropped"] += n
            warn = not ok and not self._warned_export
            if warn:
                self._warned_export = True
        if warn:
            log.warning("tracing: spans could not be exported to %s; they are dropped (counted)", self.endpoint)


class _Bounded(SpanProcessor):
    """A span processor in front of the SDK's batch processor that counts spans and keeps at most
    :data:`MAX_QUEUE` waiting."""

    def __init__(self, inner: Any, tracing: Tracing):
        self._inner, self._tracing = inner, tracing

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self._inner.on_start(span, parent_context=parent_context)

    def on_end(self, span: Any) -> None:
        if self._tracing._admit():
            self._inner.on_end(span)

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class _CountingExporter(SpanExporter):
    """The OTLP exporter, counting what it exported and what failed."""

    def __init__(self, inner: Any, tracing: Tracing):
        self._inner, self._tracing = inner, tracing

    def export(self, spans: Any) -> Any:
        try:
            result = self._inner.export(spans)
        except Exception as e:
            log.debug("tracing export failed: %s", e)
            result = SpanExportResult.FAILURE
        self._tracing._exported(len(spans), result == SpanExportResult.SUCCESS)
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
