"""Disaggregated serving on a real tritonserver: prefill instances stream KV over NIXL into
decode instances; outputs, routing, metrics and faults (cancel, pool full, prefill killed)."""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import pytest

from backend.client import stream_generate
from tests.conftest import (
    DISAGG_MODELS,
    PROMPTS,
    generate_concurrently,
    hf_greedy,
    metric_values,
    wait_metric,
    wait_pool_free,
)

N_TOKENS = 12


@pytest.fixture(autouse=True)
def pools_back_to_free(disagg_server, request):
    yield
    skip = getattr(request.node, "killed_models", set())
    for model in DISAGG_MODELS:
        if model not in skip:
            wait_pool_free(disagg_server.metrics_url, model, timeout_s=30)
    deadline = time.monotonic() + 30  # the front relays nothing any more (cancelled streams end)
    while sum(metric_values(disagg_server.metrics_url, "triton_disagg_requests_active", model="llm")) != 0:
        assert time.monotonic() < deadline, "the front model still counts requests in flight"
        time.sleep(0.2)


def run_concurrently(url, prompts, model, n_tokens=N_TOKENS, **kw):
    return generate_concurrently(url, prompts, model, n_tokens, **kw)


def total(url, name, model_prefix):
    return sum(v for m in DISAGG_MODELS if m.startswith(model_prefix) for v in metric_values(url, name, model=m))


def test_disagg_outputs_identical_to_aggregated_and_transformers(disagg_server, hf_model, tokenizer):

    url = disagg_server.grpc_url
    writes_before = total(disagg_server.metrics_url, "triton_disagg_kv_writes_total", "decode")
    disagg = run_concurrently(url, PROMPTS, "llm")  # 8 requests in flight at once
    assert all(r.error is None for r in disagg), [r.error for r in disagg]
    agg = run_concurrently(url, PROMPTS, "llm_aggregated")
    assert [r.token_ids for r in disagg] == [r.token_ids for r in agg]

    lengths = []
    for prompt, res in zip(PROMPTS, disagg):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        lengths.append(len(ids))
        assert res.token_ids == hf_greedy(hf_model, ids, N_TOKENS), prompt[:40]
    assert max(lengths) - 1 >= 3 * 64, "a prompt must need 3+ prefill chunks at the 64-token budget"

    # Every page of every layer is written once (HND, TP 1 -> TP 1): the plan's count.
    want = sum(math.ceil((n - 1) / 16) * 30 for n in lengths)
    time.sleep(0.6)  # metrics refresh period
    got = total(disagg_server.metrics_url, "triton_disagg_kv_writes_total", "decode") - writes_before
    assert got == want


def test_both_decode_and_prefill_instances_serve(disagg_server):
    run_concurrently(disagg_server.grpc_url, PROMPTS[:4], "llm", n_tokens=4)
    url = disagg_server.metrics_url
    for m in ("decode_0", "decode_1"):
        wait_metric(url, "triton_disagg_requests_total", 1, model=m)
    for m in ("prefill_0", "prefill_1"):
        wait_metric(url, "triton_disagg_kv_writes_total", 1, model=m)


def test_streams_paris_over_http(disagg_server):
    import json

    import requests

    r = requests.post(
        f"http://{disagg_server.http_url}/v2/models/llm/generate_stream",
        stream=True,
        timeout=120,
        json={
            "text_input": "What is the capital of France?",
            "max_tokens": 24,
            "stream": True,
            "apply_chat_template": True,
        },
    )
    events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: ")]
    assert r.status_code == 200 and len(events) > 3
    assert "Paris" in "".join(e["text_output"] for e in events)


def test_client_cancel_during_prefill_frees_both_sides(disagg_server):
    long_prompt = "Describe this list. " + " ".join(f"entry {i}" for i in range(400))
    res = stream_generate(disagg_server.grpc_url, long_prompt, 32, model="llm", cancel_after_s=0.4)
    assert not res.token_ids, "the prefill should still have been running when the client cancelled"
    deadline = time.monotonic() + 10
    while "cancelled by the client while its prefill runs" not in disagg_server.log_file.read_text():
        assert time.monotonic() < deadline, "the cancel did not reach the decode instance during the prefill"
        time.sleep(0.2)
    for m in DISAGG_MODELS:
        wait_pool_free(disagg_server.metrics_url, m, timeout_s=30)
    again = run_concurrently(disagg_server.grpc_url, PROMPTS[:2], "llm")
    ref = run_concurrently(disagg_server.grpc_url, PROMPTS[:2], "llm_aggregated")
    assert [r.token_ids for r in again] == [r.token_ids for r in ref]


def test_decode_pool_full_queues_then_overloaded(disagg_server):
    prompt = "Tell me a story about " + "a very long road and " * 30
    results = run_concurrently(disagg_server.grpc_url, [prompt] * 4, "decode_2", n_tokens=150)
    errors = [r.error for r in results if r.error]
    ok = [r for r in results if r.error is None]
    assert ok, errors
    assert errors and all("[overloaded]" in e for e in errors), errors


def test_prefill_model_refuses_direct_requests(disagg_server):
    import requests

    r = requests.post(
        f"http://{disagg_server.http_url}/v2/models/prefill_0/generate", json={"text_input": "hello"}, timeout=60
    )
    assert r.status_code >= 400 and "KV messenger" in r.text, r.text


def test_prefill_killed_mid_transfer(disagg_server, request):
    """Runs last: kills a prefill instance while it serves; its requests are computed again
    (another prefill instance, or the decode instance) and complete, decode pages are freed, and
    later requests succeed on the remaining prefill instance."""
    url = disagg_server.metrics_url
    long_prompt = "Describe this list. " + " ".join(f"entry {i}" for i in range(500))
    results = [None, None]

    def run(i):
        results[i] = stream_generate(disagg_server.grpc_url, long_prompt, 8, model="llm", timeout_s=120)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    victim = None
    deadline = time.monotonic() + 20
    while victim is None and time.monotonic() < deadline:
        time.sleep(0.1)
        for m in ("prefill_1", "prefill_0"):
            if any(v > 0 for v in metric_values(url, "triton_disagg_prefill_queue_depth", model=m)):
                victim = m
                break
    assert victim, "no prefill instance picked up the requests"
    pid = disagg_server.instance_pids()[f"{victim}_0_0"]

    def recomputed() -> float:
        return sum(
            sum(metric_values(url, "triton_disagg_kv_loads_recomputed_total", model=m))
            for m in DISAGG_MODELS
            if m.startswith("decode")
        )

    before = recomputed()
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    request.node.killed_models = {victim}
    # the decode instances take the lost loads up at once (kv_load_failure_policy=recompute), not
    # after a transfer deadline: bounded by when the kill is noticed, not by the machine's speed
    while recomputed() < before + 1:
        assert time.monotonic() - t_kill < 15, f"lost loads not taken up for recompute: {recomputed() - before}"
        time.sleep(0.1)
    noticed = time.monotonic() - t_kill
    [t.join(120) for t in threads]
    assert [r.error for r in results] == [None, None]
    assert results[0].token_ids == results[1].token_ids and len(results[0].token_ids) == 8
    print(
        f"prefill {victim} killed: loads recomputed {noticed:.1f} s later, done {time.monotonic() - t_kill:.1f} s after"
    )
    for m in DISAGG_MODELS:
        if m != victim:
            wait_pool_free(url, m, timeout_s=30)
    after = run_concurrently(disagg_server.grpc_url, PROMPTS[:3], "llm", n_tokens=6)
    assert all(r.error is None and len(r.token_ids) == 6 for r in after), [r.error for r in after]
