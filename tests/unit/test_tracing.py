"""Tracing (``backend/cluster/tracing.py``) against a real OTLP/HTTP receiver in this process:
spans join a client's trace through ``traceparent`` and nest across "processes" (two Tracing
objects); a malformed ``traceparent`` starts a new trace and is logged once; an unreachable
collector never blocks a span and its spans are counted as dropped; off, nothing is recorded.
The same across a real deployment: ``tests/integration/test_tracing_e2e.py``."""

from __future__ import annotations

import logging
import socket
import time

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
