"""One request's trace across a real disaggregated deployment (the front, 1 prefill and 2 decode
instances of a real tritonserver, real NIXL, the real model) exported over OTLP/HTTP to a real
receiver in the test:

- a request whose client sends a W3C ``traceparent`` (gRPC metadata) yields one trace with spans
  from three processes (front, decode, prefill) in parent/child order (client -> front request ->
  route attempt -> decode -> KV transfer -> prefill), Triton's own spans (its OpenTelemetry trace
  mode: the request, the model) between the client and the front and between the route and the
  decode instance, its KV bytes equal to the transfer metric, its token counts equal to what the
  client got;
- the same through Triton's HTTP ``generate_stream`` with the ``traceparent`` header (Triton's
  trace mode reads it) or, for a client that cannot set headers, in its JSON body, and through the
  OpenAI frontend (its own span from the HTTP ``traceparent`` header, then its attempt, then the
  decode and prefill instances');
- a malformed ``traceparent`` starts a new trace, and the request is served;
- a request whose decode instance is killed mid-stream shows both attempts and the move;
- a request that asks for its figures (``return_perf_metrics``) gets them in its last response:
  the KV bytes equal to the transfer metric, its times in order, its moves.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests

from backend.client import stream_generate
from backend.cluster.otlp_receiver import OTLPReceiver
from tests.conftest import EXACT, deployment_server, hf_greedy, metric_values, wait_metric, wait_pool_free

pytestmark = pytest.mark.usefixtures("nixl")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
PROMPT = "The three primary colors are red, yellow and blue. Mixing red and yellow gives"


@pytest.fixture(scope="module")
def traced(model_dir, tmp_path_factory):
    with OTLPReceiver() as receiver:
        with deployment_server(
            tmp_path_factory,
            "traced",
            mode="disagg",
            model_path=str(model_dir),
            prefill_instances=1,
            decode_instances=2,
            overrides={
                "kv_cache_tokens": "2048",
                "num_threads": "1",
                "otlp_endpoint": receiver.url,
                "local_prefill_max_tokens": "0",  # every prompt goes to the prefill instance
                **EXACT,
            },
            per_model={"front": {"health_probe_interval_s": "0.5"}},
        ) as server:
            from backend.disagg.auth import SECRET_ENV
            from backend.launch.openai_frontend import OpenAIFrontend

            assert server.etcd is not None
            frontend = OpenAIFrontend(
                server.grpc_url,
                model_dir,
                served_model_name="smol",
                discovery=server.etcd.url,
                extra_env={SECRET_ENV: server.deployment_secret},
                log_file=server.log_file.with_name("openai.log"),
                otlp_endpoint=receiver.url,
            )
            frontend.start()
            server.openai = frontend
            try:
                yield server, receiver
            finally:
                frontend.stop()


def _trace(receiver: OTLPReceiver, trace_id: str, want: set[str]) -> dict:
    """The trace's spans by id, once it has spans of the names in ``want`` and is whole: every
    span's parent is in it, or is the client's (Triton exports its own spans as each call ends)."""

    def whole(got) -> bool:
        mine = {x.span_id: x for x in got if x.trace_id == trace_id}
        names = {x.name.split(" ")[0] for x in mine.values()}
        return want <= names and all(x.parent_span_id in mine or x.parent_span_id == CLIENT_SPAN for x in mine.values())

    return {s.span_id: s for s in receiver.wait_for(whole) if s.trace_id == trace_id}


def _caller(span, spans: dict) -> tuple[str, list[str]]:
    """The span's nearest ancestor that is not Triton's own, and the names of Triton's spans passed
    on the way (its request, then the model, from the caller down)."""
    parent, passed = span.parent_span_id, []
    while parent in spans and spans[parent].service == "tritonserver":
        passed.insert(0, spans[parent].name)
        parent = spans[parent].parent_span_id
    return parent, passed


def test_one_request_is_one_trace_across_front_decode_and_prefill(traced, tokenizer, hf_model):
    server, receiver = traced
    for m in ("decode_0", "decode_1"):
        wait_metric(server.metrics_url, "triton_disagg_decode_target_up", 1, timeout_s=60, target=m)
    received = lambda m: sum(metric_values(server.metrics_url, "triton_disagg_kv_transfer_bytes_total", model=m))  # noqa: E731
    before = {m: received(m) for m in ("decode_0", "decode_1")}
    res = stream_generate(
        server.grpc_url, PROMPT, 8, ignore_eos=True, traceparent=f"00-{TRACE_ID}-{CLIENT_SPAN}-01", perf_metrics=True
    )
    assert res.error is None
    assert res.token_ids == hf_greedy(hf_model, tokenizer(PROMPT, add_special_tokens=False)["input_ids"], 8)
    spans = _trace(receiver, TRACE_ID, {"text_completion", "route", "decode", "kv_transfer", "prefill"})
    by_name = {s.name.split(" ")[0]: s for s in spans.values()}
    front, route, decode = by_name["text_completion"], by_name["route"], by_name["decode"]
    kv, prefill = by_name["kv_transfer"], by_name["prefill"]
    model = decode.instance.rsplit("_", 2)[0]  # its Triton instance decode_<i>_0_0
    # parent/child across the three processes, Triton's own spans between the calls it carried
    assert _caller(front, spans) == (CLIENT_SPAN, ["InferRequest", "llm"])
    assert route.parent_span_id == front.span_id
    assert _caller(decode, spans) == (route.span_id, ["InferRequest", model])
    assert kv.parent_span_id == decode.span_id and prefill.parent_span_id == kv.span_id
    services = {s.service for s in (front, decode, prefill)}
    assert services == {"triton-disagg-front", "triton-disagg-decode", "triton-disagg-prefill"}
    assert len({s.instance for s in (front, decode, prefill)}) == 3
    assert front.start_ns <= route.start_ns <= decode.start_ns <= kv.start_ns <= prefill.start_ns
    assert prefill.end_ns <= decode.end_ns <= front.end_ns
    # what the spans say equals what happened
    n_prompt = len(tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    assert front.attributes["gen_ai.usage.output_tokens"] == 8
    assert front.attributes["gen_ai.usage.input_tokens"] == n_prompt
    assert decode.attributes["gen_ai.usage.output_tokens"] == 8
    assert decode.attributes["gen_ai.usage.input_tokens"] == n_prompt
    assert front.attributes["gen_ai.operation.name"] == "text_completion"
    assert route.attributes["triton_disagg.target"].startswith(f"vm-{model}-")  # its membership name
    sent = wait_metric(server.metrics_url, "triton_disagg_kv_transfer_bytes_total", before[model] + 1, model=model)
    assert kv.attributes["triton_disagg.kv.bytes"] == sent - before[model]
    # the request's own figures (return_perf_metrics), in its last response
    perf = res.perf
    assert perf is not None and perf["kv_bytes"] == sent - before[model] and perf["prefill"] == "remote"
    assert perf["prompt_tokens"] == n_prompt and perf["output_tokens"] == 8 and perf["cached_tokens"] == 0
    assert perf["migrations"] == 0 and perf["attempts"] == 1
    assert perf["kv_pages"] == kv.attributes["triton_disagg.kv.pages"]
    assert 0 <= perf["prefill_queue_s"] <= perf["kv_wait_s"] < perf["ttft_s"] <= perf["e2e_s"]
    assert 0 < perf["kv_transfer_s"] <= perf["kv_wait_s"] and perf["front_ttft_s"] >= perf["ttft_s"]
    assert prefill.attributes["triton_disagg.prompt_tokens"] == n_prompt - 1  # all but the last
    events = [e[0] for e in prefill.events]
    assert {"started", "chunk", "computed", "kv_sent"} <= set(events) and events[-1] == "kv_sent", events
    layers = [e[1] for e in prefill.events if e[0] == "kv_layer_sent"]  # each layer's writes, once (one chunk)
    assert sorted(x["triton_disagg.layer"] for x in layers) == list(range(30)), layers
    assert sum(x["triton_disagg.kv.bytes"] for x in layers) == kv.attributes["triton_disagg.kv.bytes"]
    assert "first_token" in [e[0] for e in decode.events] and "prefill_started" in [e[0] for e in kv.events]
    assert all(s.status_code != 2 for s in spans.values())  # none failed
    assert sum(metric_values(server.metrics_url, "triton_disagg_trace_spans_dropped_total")) == 0


def test_the_openai_frontend_joins_the_clients_trace_too(traced, tokenizer, hf_model):
    server, receiver = traced
    trace_id = "6bf92f3577b34da6a3ce929d0e0e4738"
    reply = requests.post(
        f"{server.openai.url}/v1/completions",
        json={"model": "smol", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    want = hf_greedy(hf_model, tokenizer(PROMPT, add_special_tokens=False)["input_ids"], 6)
    assert reply.json()["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True)
    spans = _trace(receiver, trace_id, {"text_completion", "route", "decode", "kv_transfer", "prefill"})
    by_name = {s.name.split(" ")[0]: s for s in spans.values()}
    front, route, decode = by_name["text_completion"], by_name["route"], by_name["decode"]
    assert front.service == "triton-disagg-openai" and front.parent_span_id == CLIENT_SPAN
    assert route.parent_span_id == front.span_id
    assert _caller(decode, spans) == (route.span_id, ["InferRequest", decode.instance.rsplit("_", 2)[0]])
    assert by_name["prefill"].parent_span_id == by_name["kv_transfer"].span_id
    assert front.attributes["gen_ai.usage.output_tokens"] == 6 and front.status_code != 2


@pytest.mark.parametrize("where", ["header", "body"])
def test_tritons_http_generate_stream_joins_the_clients_trace(traced, where):
    """Triton's HTTP ``generate_stream`` forwards no header to the models, but Triton's trace mode
    reads the W3C ``traceparent`` header (its spans, then ours, join the client's trace); for a
    client that cannot set headers, a field of its JSON body that is not an input is a request
    parameter, and ``traceparent`` there joins the trace too (Triton's spans, which saw no
    header, are then a trace of their own)."""
    server, receiver = traced
    trace_id = {"header": "8bf92f3577b34da6a3ce929d0e0e4730", "body": "7bf92f3577b34da6a3ce929d0e0e4739"}[where]
    traceparent = f"00-{trace_id}-{CLIENT_SPAN}-01"
    reply = requests.post(
        f"http://{server.http_url}/v2/models/llm/generate_stream",
        json={
            "text_input": PROMPT,
            "max_tokens": 4,
            "stream": True,
            "ignore_eos": True,
            **({"traceparent": traceparent} if where == "body" else {}),
        },
        headers={"traceparent": traceparent} if where == "header" else {},
        stream=True,
        timeout=120,
    )
    events = [line for line in reply.iter_lines() if line.startswith(b"data: ")]
    assert reply.status_code == 200 and len(events) >= 1
    want = {"text_completion", "route", "decode", "prefill"} | ({"InferRequest", "llm"} if where == "header" else set())
    spans = _trace(receiver, trace_id, want)
    front = next(s for s in spans.values() if s.name.startswith("text_completion"))
    assert front.service == "triton-disagg-front"
    assert _caller(front, spans) == (CLIENT_SPAN, ["InferRequest", "llm"] if where == "header" else [])


def test_a_malformed_traceparent_starts_a_new_trace(traced):
    server, receiver = traced
    res = stream_generate(server.grpc_url, "Hello", 4, ignore_eos=True, traceparent="00-not-a-trace-01")
    assert res.error is None and len(res.token_ids) == 4
    fronts = receiver.wait_for(
        lambda s: any(x.name.startswith("text_completion") and x.parent_span_id == "" for x in s)
    )
    root = next(x for x in fronts if x.name.startswith("text_completion") and x.parent_span_id == "")
    assert root.trace_id != TRACE_ID
    assert "malformed traceparent" in server.log_file.read_text(errors="replace")


def test_a_moved_request_shows_both_attempts(traced, tokenizer, hf_model):
    """kill -9 of the decode instance serving a stream: its trace has two route spans (the first
    failed), the move as an event, and the client's tokens equal transformers'."""
    server, receiver = traced
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    received: list[str] = []
    result: list = []
    thread = threading.Thread(
        target=lambda: result.append(
            stream_generate(
                server.grpc_url,
                PROMPT,
                96,
                ignore_eos=True,
                on_text=received.append,
                traceparent=f"00-{trace_id}-{CLIENT_SPAN}-01",
                perf_metrics=True,
            )
        )
    )
    thread.start()
    deadline = time.monotonic() + 120
    while len(received) < 10:
        assert time.monotonic() < deadline and thread.is_alive(), "the stream did not start"
        time.sleep(0.05)
    victim = None
    for m in ("decode_0", "decode_1"):
        if sum(metric_values(server.metrics_url, "triton_disagg_requests_active", model=m)):
            victim = m
    assert victim is not None
    os.kill(server.instance_pids()[f"{victim}_0_0"], signal.SIGKILL)
    thread.join(300)
    res = result[0]
    assert res.error is None
    assert res.token_ids == hf_greedy(hf_model, tokenizer(PROMPT, add_special_tokens=False)["input_ids"], 96)
    spans = receiver.wait_for(
        lambda s: (
            sum(x.name.startswith("route") for x in s if x.trace_id == trace_id) == 2
            and any(x.name.startswith("text_completion") for x in s if x.trace_id == trace_id)
        )
    )
    mine = [s for s in spans if s.trace_id == trace_id]
    routes = sorted((s for s in mine if s.name.startswith("route")), key=lambda s: s.start_ns)
    front = next(s for s in mine if s.name.startswith("text_completion"))
    assert [r.attributes["triton_disagg.attempt"] for r in routes] == [1, 2]
    assert routes[0].attributes["triton_disagg.target"].startswith(f"vm-{victim}-") and routes[0].status_code == 2
    assert not routes[1].attributes["triton_disagg.target"].startswith(f"vm-{victim}-")
    assert routes[1].status_code != 2
    assert routes[1].attributes["triton_disagg.resumed_tokens"] >= 10
    moves = [e for e in front.events if e[0] == "triton_disagg.migration"]
    assert len(moves) == 1 and moves[0][1]["triton_disagg.from"] == routes[0].attributes["triton_disagg.target"]
    assert front.attributes["gen_ai.usage.output_tokens"] == 96 and front.attributes["triton_disagg.attempts"] == 2
    assert res.perf is not None and res.perf["migrations"] == 1 and res.perf["attempts"] == 2
    assert res.perf["output_tokens"] == 96  # the whole output, counted by the instance it ended on
    for m in ("prefill_0", "decode_0", "decode_1"):
        wait_pool_free(server.metrics_url, m, timeout_s=240)
