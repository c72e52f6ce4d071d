"""Guard test (issue 11): every client input gets the worst values of its type (NaN and
infinities, extreme integers, empty, invalid UTF-8, oversized and multi-element strings), on
the aggregated model and through the disaggregated front. Each request is answered (tokens
or a clear error, never a hang) and nothing leaks: requests in flight and free KV pages go
back to where they started."""

from __future__ import annotations

import threading
import time

import numpy as np

from backend.serving.tensors import INPUTS
from tests.conftest import metric_values, wait_pool_free

HUGE = "a" * (2 << 20)  # over max_input_bytes, max_grammar_bytes and the stop-word limit
WORST = {
    "TYPE_STRING": [
        ("empty", np.array([b""], dtype=object)),
        ("nul", np.array([b"\x00"], dtype=object)),
        ("invalid utf-8", np.array([b"\xff\xfe\xfd"], dtype=object)),
        ("2 MiB", np.array([HUGE.encode()], dtype=object)),
        ("two values", np.array([b"a", b"b"], dtype=object)),
    ],
    "TYPE_INT32": [
        ("int32 min", np.array([-(2**31)], dtype=np.int32)),
        ("int32 max", np.array([2**31 - 1], dtype=np.int32)),
        ("-1", np.array([-1], dtype=np.int32)),
        ("0", np.array([0], dtype=np.int32)),
        ("two values", np.array([1, 2], dtype=np.int32)),
    ],
    "TYPE_UINT64": [("uint64 max", np.array([2**64 - 1], dtype=np.uint64)), ("0", np.array([0], dtype=np.uint64))],
    "TYPE_FP32": [
        ("nan", np.array([np.nan], dtype=np.float32)),
        ("inf", np.array([np.inf], dtype=np.float32)),
        ("-inf", np.array([-np.inf], dtype=np.float32)),
        ("-1", np.array([-1.0], dtype=np.float32)),
        ("fp32 max", np.array([np.finfo(np.float32).max], dtype=np.float32)),
    ],
    "TYPE_BOOL": [("two values", np.array([True, False], dtype=bool))],
}
TRITON_TYPES = {
    "TYPE_STRING": "BYTES",
    "TYPE_INT32": "INT32",
    "TYPE_UINT64": "UINT64",
    "TYPE_FP32": "FP32",
    "TYPE_BOOL": "BOOL",
}
CASES = [(spec.name, label, value, spec.data_type) for spec in INPUTS for label, value in WORST[spec.data_type]]


def send(url: str, model: str, overrides: dict, timeout_s: float = 60.0):
    """One streamed request; returns (error or None, tokens received, finish reason or None).
    Fails on a hang."""
    import tritonclient.grpc as grpcclient

    base = {
        "text_input": (np.array([b"Hi"], dtype=object), "BYTES"),
        "max_tokens": (np.array([4], dtype=np.int32), "INT32"),
        "stream": (np.array([True], dtype=bool), "BOOL"),
    }
    base.update(overrides)
    inputs = []
    for name, (arr, dtype) in base.items():
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    done, box = threading.Event(), {"error": None, "tokens": 0, "finish": None}

    def callback(result, error):
        if error is not None:
            box["error"] = str(error)
            done.set()
            return
        ids = result.as_numpy("output_token_ids")
        box["tokens"] += 0 if ids is None else ids.size
        reason = result.as_numpy("finish_reason")
        if reason is not None and reason.size and reason.reshape(-1)[0]:
            box["finish"] = reason.reshape(-1)[0].decode()
        if result.get_response().parameters.get("triton_final_response").bool_param:
            done.set()

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=callback)
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        assert done.wait(timeout_s), f"no final answer within {timeout_s}s for {list(overrides)}"
    finally:
        client.stop_stream()
        client.close()
    return box["error"], box["tokens"], box["finish"]


def active(url: str, models) -> float:
    return sum(sum(metric_values(url, "triton_disagg_requests_active", model=m)) for m in models)


def wait_active(url: str, models, value: float, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while active(url, models) != value:
        assert time.monotonic() < deadline, f"requests_active stuck at {active(url, models)} (expected {value})"
        time.sleep(0.25)


def feed_worst(server, model: str, pool_models: list[str]) -> list:
    url = server.metrics_url
    for m in pool_models:
        wait_pool_free(url, m, timeout_s=60)
    start_active = active(url, pool_models)
    outcomes = []
    for name, label, value, data_type in CASES:
        error, tokens, finish = send(server.grpc_url, model, {name: (value, TRITON_TYPES[data_type])})
        # an answer without a token is one that says why it ended (resume_token_ids [1, 2] ends
        # on SmolLM2's end token 2: the moved request's output is already complete)
        assert error or tokens or finish, f"{name}={label}: neither tokens, a finish reason nor an error"
        kind = "error" if error else f"{tokens} tokens, {finish}"
        outcomes.append((name, label, kind, (error or "")[:90]))
    wait_active(url, pool_models, start_active)
    for m in pool_models:
        wait_pool_free(url, m, timeout_s=60)
    refused = sum(o[2] == "error" for o in outcomes)
    print(f"{model}: {len(outcomes)} worst-value requests, {refused} refused, {len(outcomes) - refused} answered")
    return outcomes


def assert_refusals(outcomes: list) -> None:
    """The answers both modes give the same way: non-finite sampling values are refused at
    admission as bad requests, and so is a prompt past ``max_input_bytes``; a resumed output
    that ends on the model's end token ends at once, with no new token."""
    out = {(n, lbl): (kind, err) for n, lbl, kind, err in outcomes}
    for label in ("nan", "inf", "-inf"):
        assert out[("temperature", label)][0] == "error" and "[bad_request]" in out[("temperature", label)][1]
        assert out[("top_p", label)][0] == "error" and "[bad_request]" in out[("top_p", label)][1]
    assert out[("text_input", "2 MiB")][0] == "error" and "max_input_bytes" in out[("text_input", "2 MiB")][1]
    assert out[("resume_token_ids", "two values")][0] == "0 tokens, stop"


def test_worst_values_aggregated(aggregated_server):
    assert_refusals(feed_worst(aggregated_server, "llm", ["llm"]))


def test_worst_values_disaggregated(nixl, disagg_server):
    assert_refusals(feed_worst(disagg_server, "llm", ["prefill_0", "prefill_1", "decode_0", "decode_1"]))
