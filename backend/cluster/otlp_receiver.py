"""A small OTLP/HTTP trace receiver (``POST /v1/traces``, protobuf or JSON) that keeps the spans it
gets: what the tests and the tracing benchmark export to (no OpenTelemetry Collector package is
available here). Decodes with ``opentelemetry-proto``; the JSON encoding (what Triton's own trace
mode sends) is read into the same message, its hex ids turned into bytes first as OTLP specifies."""

from __future__ import annotations

import base64
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    service: str
    instance: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    status_code: int = 0
    status_message: str = ""


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _b64(hex_id: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_id)).decode()


def _ids_to_base64(node: Any) -> Any:
    """OTLP's JSON writes trace and span ids in hex, where protobuf's JSON mapping wants base64."""
    if isinstance(node, dict):
        return {k: _b64(v) if k in _ID_KEYS and isinstance(v, str) else _ids_to_base64(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_ids_to_base64(x) for x in node]
    return node


def parse_export(body: bytes, content_type: str):
    """An ``ExportTraceServiceRequest`` from an OTLP/HTTP body, protobuf or JSON (by its
    ``Content-Type``)."""
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    if content_type.split(";")[0].strip().lower() == "application/json":
        json_format.ParseDict(_ids_to_base64(json.loads(body)), request, ignore_unknown_fields=True)
    else:
        request.ParseFromString(body)
    return request


class OTLPReceiver:
    """``with OTLPReceiver() as r:`` ... ``r.url`` (give it as the OTLP endpoint), ``r.spans()``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        receiver = self
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.requests = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                ok = self.path.rstrip("/") == "/v1/traces"
                if ok:
                    receiver._take(body, self.headers.get("Content-Type", ""))
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    def __enter__(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _take(self, body: bytes, content_type: str = "application/x-protobuf") -> None:
        request = parse_export(body, content_type)
        spans = []
        for rs in request.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        ReceivedSpan(
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            name=s.name,
                            kind=s.kind,
                            service=str(resource.get("service.name", "")),
                            instance=str(resource.get("service.instance.id", "")),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes=_attrs(s.attributes),
                            events=[(e.name, _attrs(e.attributes)) for e in s.events],
                            status_code=s.status.code,
                            status_message=s.status.message,
                        )
                    )
        with self._lock:
            self.requests += 1
            self._spans.extend(spans)

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def wait_for(self, predicate, timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """Wait until ``predicate(spans)`` holds for the spans received; return them (or fail)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted((s.service, s.name) for s in spans)
                raise AssertionError(f"spans received within {timeout_s:g} s do not match: {names}")
            time.sleep(0.1)
