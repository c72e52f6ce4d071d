"""Tracing (``backend/cluster/tracing.py``) against a real OTLP/HTTP receiver in this process:
spans join a client's trace through ``traceparent`` and nest across "processes" (two Tracing
objects); a malformed ``traceparent`` starts a new trace and is logged once; an unreachable
collector never blocks a span and its spans are counted as dropped; off, nothing is recorded.
The same across a real deployment: ``tests/integration/test_tracing_e2e.py``."""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.request

from backend.cluster import otlp_tracing
from backend.cluster.otlp_receiver import OTLPReceiver
from backend.cluster.tracing import NO_SPAN, start_tracing

CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_spans_of_two_processes_join_the_clients_trace():
    with OTLPReceiver() as receiver:
        front = start_tracing(receiver.url, "front", "llm_0")
        decode = start_tracing(receiver.url, "decode", "decode_0")
        root = front.span("text_completion m", CLIENT, {"gen_ai.operation.name": "text_completion"})
        attempt = root.child("route decode_0", {"triton_disagg.attempt": 1}, kind="client")
        served = decode.span("decode", attempt.traceparent(), {"triton_disagg.role": "decode"})
        served.event("first_token", {"triton_disagg.ttft_s": 0.1})
        served.set({"gen_ai.usage.output_tokens": 8})
        served.end()
        attempt.end()
        root.end(error=None)
        front.close()
        decode.close()
        spans = {s.name: s for s in receiver.wait_for(lambda s: len(s) == 3)}
    trace_id = CLIENT.split("-")[1]
    assert {s.trace_id for s in spans.values()} == {trace_id}
    assert spans["text_completion m"].parent_span_id == CLIENT.split("-")[2]
    assert spans["route decode_0"].parent_span_id == spans["text_completion m"].span_id
    assert spans["decode"].parent_span_id == spans["route decode_0"].span_id
    assert spans["decode"].service == "triton-disagg-decode" and spans["decode"].instance == "decode_0"
    assert spans["decode"].events == [("first_token", {"triton_disagg.ttft_s": 0.1})]
    assert spans["decode"].attributes["gen_ai.usage.output_tokens"] == 8
    assert front.stats() == {"spans_ended": 2, "spans_dropped": 0}


def test_a_malformed_traceparent_starts_a_new_trace_logged_once(caplog):
    with OTLPReceiver() as receiver:
        t = start_tracing(receiver.url, "front", "llm_0")
        with caplog.at_level(logging.WARNING, logger="triton_disagg.tracing"):
            for bad in ("garbage", "00-zz-yy-01"):
                span = t.span("req", bad)
                span.end(error="it failed")
        t.close()
        spans = receiver.wait_for(lambda s: len(s) == 2)
    assert all(s.parent_span_id == "" for s in spans) and len({s.trace_id for s in spans}) == 2
    assert spans[0].status_code == 2 and spans[0].status_message == "it failed"  # STATUS_CODE_ERROR
    assert caplog.text.count("malformed traceparent") == 1


def test_an_unreachable_collector_never_blocks_and_its_spans_are_counted_dropped(monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(otlp_tracing, "MAX_QUEUE", 50)
    t = start_tracing(f"http://127.0.0.1:{port}", "front", "llm_0")
    start = time.perf_counter()
    for i in range(200):
        t.span(f"req {i}").end()
    assert time.perf_counter() - start < 1.0  # ending a span never waits for the collector
    deadline = time.monotonic() + 20
    while t.stats()["spans_dropped"] < 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert t.stats() == {"spans_ended": 200, "spans_dropped": 200}
    t.close()


def test_tracing_off_records_nothing():
    t = start_tracing("", "front", "llm_0")
    assert not t.enabled and t.span("x", CLIENT) is NO_SPAN and NO_SPAN.traceparent() == ""
    assert NO_SPAN.child("y") is NO_SPAN


class _Request:
    """A Triton request as the Python backend shows it: its parameters (JSON) and its trace."""

    def __init__(self, parameters: dict, tritons: str | None, has_trace: bool = True):
        self._parameters, self._tritons, self._has_trace = parameters, tritons, has_trace

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def trace(self):
        if not self._has_trace:
            raise AttributeError("trace")
        context = None if self._tritons is None else json.dumps({"traceparent": self._tritons})
        return type("Trace", (), {"get_context": lambda _self: context})()


CLIENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRITONS_CHILD = "00-4bf92f3577b34da6a3ce929d0e0e4736-1111111111111111-01"  # Triton's model span, same trace
TRITONS_NEW = "00-99999999999999999999999999999999-2222222222222222-01"  # Triton saw no header


def test_a_triton_requests_trace_context_prefers_tritons_span_in_the_same_trace():
    from backend.triton.trace_context import traceparent_of

    # the header through Triton's trace mode (gRPC metadata also forwarded as the parameter)
    assert traceparent_of(_Request({"traceparent": CLIENT}, TRITONS_CHILD)) == TRITONS_CHILD
    # the header on generate_stream: Triton's trace mode only (no parameter)
    assert traceparent_of(_Request({}, TRITONS_CHILD)) == TRITONS_CHILD
    # a body field, no header: the client's trace, not the one Triton started
    assert traceparent_of(_Request({"traceparent": CLIENT}, TRITONS_NEW)) == CLIENT
    # HTTP infer forwards the header as the client spelt it
    assert traceparent_of(_Request({"Traceparent": CLIENT}, None)) == CLIENT
    # no trace mode, no trace API (a BLS request), nothing at all
    assert traceparent_of(_Request({"traceparent": CLIENT}, None, has_trace=False)) == CLIENT
    assert traceparent_of(_Request({}, None)) == ""
    # a malformed parameter stays the caller's (the tracer logs it and starts a new trace)
    assert traceparent_of(_Request({"traceparent": "00-not-a-trace-01"}, TRITONS_NEW)) == "00-not-a-trace-01"


def test_the_receiver_reads_otlp_json_as_triton_sends_it():
    """Triton's trace mode exports OTLP/HTTP in JSON, ids in hex (as OTLP's JSON encoding says)."""
    body = {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "tritonserver"}}]},
                "scopeSpans": [
                    {
                        "scope": {"name": "triton-server"},
                        "spans": [
                            {
                                "traceId": "0af7651916cd43dd8448eb211c80319c",
                                "spanId": "dc80f2dd9cdea0dd",
                                "parentSpanId": "b7ad6b7169203331",
                                "name": "InferRequest",
                                "kind": 2,
                                "startTimeUnixNano": "1796644951449285172",
                                "endTimeUnixNano": "1796644951496232489",
                                "attributes": [{"key": "triton.model_version", "value": {"intValue": "1"}}],
                                "events": [{"name": "HTTP_RECV_START", "timeUnixNano": "1796644951449249195"}],
                            }
                        ],
                    }
                ],
            }
        ]
    }
    with OTLPReceiver() as receiver:
        request = urllib.request.Request(
            f"{receiver.url}/v1/traces", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        assert urllib.request.urlopen(request, timeout=10).status == 200
        (span,) = receiver.spans()
    assert (span.trace_id, span.span_id, span.parent_span_id) == (
        "0af7651916cd43dd8448eb211c80319c",
        "dc80f2dd9cdea0dd",
        "b7ad6b7169203331",
    )
    assert (span.name, span.service, span.start_ns, span.end_ns) == (
        "InferRequest",
        "tritonserver",
        1796644951449285172,
        1796644951496232489,
    )
    assert span.attributes == {"triton.model_version": 1} and span.events == [("HTTP_RECV_START", {})]


def test_a_traced_server_runs_tritons_trace_mode_to_the_same_collector(tmp_path):
    from backend.launch.server import TritonServer

    plain = TritonServer(tmp_path).command()
    traced = TritonServer(tmp_path, otlp_endpoint="http://127.0.0.1:4318/").command()
    assert "--trace-config" not in plain
    config = [traced[i + 1] for i, a in enumerate(traced) if a == "--trace-config"]
    assert "mode=opentelemetry" in config and "rate=1" in config
    assert "opentelemetry,url=http://127.0.0.1:4318/v1/traces" in config
