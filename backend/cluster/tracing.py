"""Tracing: one request's spans across the deployment's processes, with OpenTelemetry.

Off by default (``otlp_endpoint`` empty: :data:`NO_TRACING`, whose spans do nothing and cost
nothing); on, each process exports its spans over OTLP/HTTP (protobuf) to
``<otlp_endpoint>/v1/traces`` with the OpenTelemetry SDK's batch processor. A span's context
travels between processes as a W3C ``traceparent`` string (:meth:`Span.traceparent`): from the
client (an HTTP header or gRPC metadata, which Triton forwards as a request parameter), from the
front to the decode instance (a request parameter), from the decode to the prefill instance (the
messenger's ``PrefillRequest``), so the spans of one request join into one trace. A malformed
``traceparent`` starts a new trace (logged once per process), never fails the request.

An unreachable or slow collector never slows serving (``otlp_tracing.py``: a bounded queue, one
exporter thread; a span dropped is counted).

Names follow OpenTelemetry's semantic conventions for generative AI where they have one
(``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.usage.input_tokens`` ...); this
project's own attributes start with ``triton_disagg.``.
"""

from __future__ import annotations

from typing import Any, Protocol

Attributes = dict[str, Any]
TRACE_HEADER = "traceparent"  # the W3C header, and the request parameter Triton forwards it as


class Span(Protocol):
    """One span: :data:`NO_SPAN` (tracing off) or one that records (``otlp_tracing.py``)."""

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        """Something that happened now within the span."""

    def set(self, attributes: Attributes) -> None:
        """Attributes learned along the way."""

    def child(self, name: str, attributes: Attributes | None = None, kind: str = "internal") -> Span:
        """A span under this one, in this process."""
        ...

    def traceparent(self) -> str:
        """This span's context as a W3C ``traceparent`` ("" when it records nothing)."""
        ...

    def end(self, error: str | None = None, at_ns: int | None = None) -> None:
        """The span ends now, or at ``at_ns`` (``time.time_ns()`` taken earlier; a second end is
        ignored); with ``error`` its status is an error saying why."""


class _NoSpan:
    """Records nothing, costs nothing."""

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        pass

    def set(self, attributes: Attributes) -> None:
        pass

    def child(self, name: str, attributes: Attributes | None = None, kind: str = "internal") -> Span:
        return self

    def traceparent(self) -> str:
        return ""

    def end(self, error: str | None = None, at_ns: int | None = None) -> None:
        pass


NO_SPAN: Span = _NoSpan()


class NoTracing:
    """Tracing off: every span is :data:`NO_SPAN`."""

    enabled = False

    def span(
        self, name: str, traceparent: str = "", attributes: Attributes | None = None, kind: str = "server"
    ) -> Span:
        return NO_SPAN

    def stats(self) -> dict[str, int]:
        return {"spans_ended": 0, "spans_dropped": 0}

    def close(self) -> None:
        pass


NO_TRACING = NoTracing()


class Tracer(Protocol):
    """Where a process's spans start: :data:`NO_TRACING`, or ``otlp_tracing.Tracing``."""

    enabled: bool

    def span(
        self, name: str, traceparent: str = "", attributes: Attributes | None = None, kind: str = "server"
    ) -> Span: ...
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...


def start_tracing(endpoint: str, service: str, instance: str) -> Tracer:
    """Tracing to ``endpoint`` (``http://HOST:PORT``), or :data:`NO_TRACING` when it is empty
    (the OpenTelemetry SDK is imported only when tracing is on)."""
    if not endpoint.strip():
        return NO_TRACING
    from backend.cluster.otlp_tracing import Tracing

    return Tracing(endpoint.strip(), service, instance)
