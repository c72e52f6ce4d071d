"""Latency histograms on the metrics port, per model: TTFT, inter-token latency and request
latency on the models that answer clients; prefill queue time and KV transfer time on decode
models. Real servers, real requests; the counts follow the requests sent."""

from __future__ import annotations

import time

from backend.client import stream_generate
from tests.conftest import metric_values, read_metrics


def _hist(url: str, name: str, **labels) -> tuple[float, float, list[tuple[float, float]]]:
    """(count, sum, [(le, cumulative count)]) of histogram ``name`` summed over matching series."""
    full = f"triton_disagg_{name}"
    count = sum(metric_values(url, f"{full}_count", **labels))
    total = sum(metric_values(url, f"{full}_sum", **labels))
    buckets: dict[float, float] = {}
    want = set(labels.items())
    for (n, lab), v in read_metrics(url).items():
        if n == f"{full}_bucket" and want <= set(lab):
            le = float(dict(lab)["le"].replace("+Inf", "inf"))
            buckets[le] = buckets.get(le, 0.0) + v
    return count, total, sorted(buckets.items())


def _check_shape(count, total, buckets):
    assert buckets and buckets[-1][0] == float("inf") and buckets[-1][1] == count
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), buckets  # cumulative
    assert total > 0


def test_aggregated_latency_histograms(aggregated_server):
    url = aggregated_server.metrics_url
    before = {n: _hist(url, n, model="llm")[0] for n in ("time_to_first_token_seconds", "e2e_request_latency_seconds")}
    itl_before = _hist(url, "inter_token_latency_seconds", model="llm")[0]
    for prompt in ("Hello there", "Count to five:"):
        res = stream_generate(aggregated_server.grpc_url, prompt, 8, ignore_eos=True, temperature=0.0)
        assert res.error is None and len(res.token_ids) == 8
    # a request is observed just after its final response is sent: give the last one a moment
    deadline = time.monotonic() + 5
    while _hist(url, "e2e_request_latency_seconds", model="llm")[0] < before["e2e_request_latency_seconds"] + 2:
        assert time.monotonic() < deadline, "the requests were not observed"
        time.sleep(0.05)
    for name, n0 in before.items():
        count, total, buckets = _hist(url, name, model="llm")
        assert count == n0 + 2, name
        _check_shape(count, total, buckets)
    count, total, buckets = _hist(url, "inter_token_latency_seconds", model="llm")
    assert count == itl_before + 2 * 7  # 8 tokens: 7 gaps each
    _check_shape(count, total, buckets)


def test_decode_models_observe_queue_and_transfer_times(disagg_server):
    url = disagg_server.metrics_url
    decodes = ("decode_0", "decode_1")
    before = sum(_hist(url, "kv_transfer_time_seconds", model=m)[0] for m in decodes)
    for prompt in ("Hello there", "Count to five:", "Name a colour:"):
        res = stream_generate(disagg_server.grpc_url, prompt, 4, ignore_eos=True, temperature=0.0)
        assert res.error is None
    deadline = time.monotonic() + 5  # the receiver's observations reach the metrics at its next refresh
    while sum(_hist(url, "kv_transfer_time_seconds", model=m)[0] for m in decodes) < before + 3:
        assert time.monotonic() < deadline, "KV transfer times were not observed"
        time.sleep(0.1)
    for name in ("kv_transfer_time_seconds", "prefill_queue_time_seconds", "time_to_first_token_seconds"):
        series = [_hist(url, name, model=m) for m in decodes]
        count = sum(s[0] for s in series)
        assert count >= 3, name
        for s in series:
            if s[0]:
                _check_shape(*s)
