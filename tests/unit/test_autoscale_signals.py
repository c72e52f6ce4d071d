"""What the autoscaler reads (backend/autoscale/signals.py): one model's series out of Triton's
Prometheus text, Prometheus' histogram_quantile interpolation, and an interval's observation
from two scrapes (deltas of counters and buckets, restarts and new instances counted from 0)."""

from __future__ import annotations

import math

import pytest

from backend.autoscale.signals import Observation, Scrape, bucket_delta, histogram_quantile, observe, parse

TEXT = """\
# HELP triton_disagg_requests_total requests finished, any outcome
# TYPE triton_disagg_requests_total counter
triton_disagg_requests_total{model="decode_0",version="1"} 12
triton_disagg_requests_total{model="prefill_0",version="1"} 99
triton_disagg_requests_active{model="decode_0",version="1"} 3
triton_disagg_output_tokens_total{model="decode_0",version="1"} 480
triton_disagg_kv_pages_used{model="decode_0",version="1"} 25
triton_disagg_kv_pages_total{model="decode_0",version="1"} 100
# HELP triton_disagg_time_to_first_token_seconds time from a request's arrival to its first token
# TYPE triton_disagg_time_to_first_token_seconds histogram
triton_disagg_time_to_first_token_seconds_bucket{model="decode_0",version="1",le="0.1"} 1
triton_disagg_time_to_first_token_seconds_bucket{model="decode_0",version="1",le="0.5"} 3
triton_disagg_time_to_first_token_seconds_bucket{model="decode_0",version="1",le="1"} 10
triton_disagg_time_to_first_token_seconds_bucket{model="decode_0",version="1",le="+Inf"} 12
triton_disagg_time_to_first_token_seconds_sum{model="decode_0",version="1"} 7.5
triton_disagg_time_to_first_token_seconds_count{model="decode_0",version="1"} 12
triton_disagg_time_to_first_token_seconds_bucket{model="prefill_0",version="1",le="0.1"} 50
triton_disagg_time_to_first_token_seconds_bucket{model="prefill_0",version="1",le="+Inf"} 99
nv_inference_request_success{model="decode_0",version="1"} 777
triton_disagg_malformed line without a value
"""


def test_parse_keeps_one_models_series_and_ignores_the_rest():
    s = parse(TEXT, "decode_0")
    assert s.values["requests_total"] == 12
    assert s.values["requests_active"] == 3
    assert s.values["output_tokens_total"] == 480
    assert s.values["kv_pages_used"] == 25
    assert s.values["time_to_first_token_seconds_sum"] == 7.5
    assert s.values["time_to_first_token_seconds_count"] == 12
    # the buckets by le, sorted, +Inf last; not mixed up with the prefill model's
    assert s.buckets["time_to_first_token_seconds"] == [(0.1, 1), (0.5, 3), (1.0, 10), (math.inf, 12)]
    # Triton's own metrics (no prefix) and unparseable lines are not there
    assert not any(k.startswith("nv_") or "inference" in k for k in s.values)
    assert "malformed" not in s.values

    p = parse(TEXT, "prefill_0")
    assert p.values == {"requests_total": 99}
    assert p.buckets == {"time_to_first_token_seconds": [(0.1, 50), (math.inf, 99)]}
    assert parse(TEXT, "decode_7") == Scrape()


def test_parse_sums_over_other_labels():
    text = (
        'triton_disagg_requests_total{model="decode_0",version="1",gpu="0"} 2\n'
        'triton_disagg_requests_total{model="decode_0",version="1",gpu="1"} 5\n'
        'triton_disagg_inter_token_latency_seconds_bucket{model="decode_0",version="1",gpu="0",le="0.01"} 4\n'
        'triton_disagg_inter_token_latency_seconds_bucket{model="decode_0",version="1",gpu="1",le="0.01"} 6\n'
    )
    s = parse(text, "decode_0")
    assert s.values["requests_total"] == 7
    assert s.buckets["inter_token_latency_seconds"] == [(0.01, 10)]


def test_histogram_quantile_interpolates_within_a_bucket():
    b = [(0.1, 1.0), (0.5, 3.0), (1.0, 10.0), (math.inf, 12.0)]
    # rank 0.5 x 12 = 6 lies in (0.5, 1]: 0.5 + 0.5 x (6 - 3) / (10 - 3)
    assert histogram_quantile(0.5, b) == pytest.approx(0.5 + 0.5 * 3 / 7)
    # rank 0.9 x 12 = 10.8 lies in the +Inf bucket: the highest finite bound
    assert histogram_quantile(0.9, b) == 1.0
    # rank 0.05 x 12 = 0.6 lies in the first bucket, whose lower bound is 0
    assert histogram_quantile(0.05, b) == pytest.approx(0.1 * 0.6 / 1.0)
    # rank 0.25 x 12 = 3 is exactly the top of (0.1, 0.5]
    assert histogram_quantile(0.25, b) == pytest.approx(0.5)


def test_histogram_quantile_of_nothing_is_nan():
    assert math.isnan(histogram_quantile(0.9, []))
    assert math.isnan(histogram_quantile(0.9, [(0.1, 0.0), (math.inf, 0.0)]))


def scrape_of(
    total: float, active: float, itl: list[float], ttft: list[float] | None = None, **values: float
) -> Scrape:
    les = [0.01, 0.05, 0.1, math.inf]
    buckets = {"inter_token_latency_seconds": list(zip(les, itl))}
    if ttft is not None:
        buckets["time_to_first_token_seconds"] = list(zip([0.5, 1.0, 2.0, math.inf], ttft))
    return Scrape({"requests_total": total, "requests_active": active, **values}, buckets)


def test_observe_takes_differences_over_the_interval():
    old = {"a": scrape_of(100, 4, [0, 0, 1000, 1000], output_tokens_total=5000)}
    # 10 more finished, 2 more in flight; 20 new ITL samples: 10 in (0.01, 0.05], 10 in (0.05, 0.1]
    new = {"a": scrape_of(110, 6, [0, 10, 1020, 1020], output_tokens_total=5400, kv_pages_used=30, kv_pages_total=120)}
    o = observe("decode", 4.0, new, old)
    assert isinstance(o, Observation)
    assert (o.role, o.instances, o.interval_s) == ("decode", 1, 4.0)
    # arrivals = finished (10) + the change of requests in flight (+2)
    assert o.arrivals_per_s == pytest.approx(12 / 4.0)
    assert o.output_tokens == pytest.approx(400 / 10)
    assert o.requests_active == 6
    assert o.kv_used_fraction == pytest.approx(30 / 120)
    # p90 of the interval's 20 samples (10 in (0.01, 0.05], 10 in (0.05, 0.1]): rank 18 in the
    # second bucket: 0.05 + 0.05 x (18 - 10) / 10. The cumulative figures (1000 samples in
    # (0.05, 0.1]) would give a different answer
    assert o.itl_p90_s == pytest.approx(0.05 + 0.05 * 8 / 10)
    cumulative = histogram_quantile(0.9, new["a"].buckets["inter_token_latency_seconds"])
    assert cumulative != pytest.approx(o.itl_p90_s)
    # no TTFT histogram at all: NaN
    assert math.isnan(o.ttft_p90_s)


def test_observe_counts_a_restarted_instance_from_zero():
    old = {"a": scrape_of(500, 0, [0, 0, 900, 900])}
    # restarted: its counters and buckets went down
    new = {"a": scrape_of(7, 0, [5, 5, 7, 7])}
    o = observe("decode", 1.0, new, old)
    assert o.arrivals_per_s == pytest.approx(7.0)
    # the quantile of the new counts: rank 0.9 x 7 = 6.3 in (0.05, 0.1]
    assert o.itl_p90_s == pytest.approx(0.05 + 0.05 * (6.3 - 5) / 2)


def test_observe_counts_a_new_instance_from_zero_and_adds_the_old_ones():
    old = {"a": scrape_of(10, 1, [0, 0, 0, 0], ttft=[5, 5, 5, 5])}
    new = {
        "a": scrape_of(14, 1, [0, 0, 0, 0], ttft=[9, 9, 9, 9]),  # +4 finished, all TTFT <= 0.5
        "b": scrape_of(3, 2, [0, 0, 0, 0], ttft=[0, 0, 3, 3]),  # new: 3 finished (TTFT in (1, 2]), 2 in flight
    }
    o = observe("decode", 2.0, new, old)
    assert o.instances == 2
    # a: 4 finished, no change in flight; b: 3 finished + 2 in flight
    assert o.arrivals_per_s == pytest.approx((4 + 3 + 2) / 2.0)
    assert o.requests_active == 3
    # 7 TTFT samples in the interval: 4 in [0, 0.5], 3 in (1, 2]; rank 6.3 -> 1 + 1 x (6.3 - 4) / 3
    assert o.ttft_p90_s == pytest.approx(1.0 + (6.3 - 4) / 3)


def test_observe_without_requests_is_nan_and_zero():
    same = {"a": scrape_of(10, 0, [1, 2, 3, 3], ttft=[1, 1, 1, 1])}
    o = observe("decode", 5.0, same, same)
    assert o.arrivals_per_s == 0.0
    assert math.isnan(o.itl_p90_s) and math.isnan(o.ttft_p90_s) and math.isnan(o.prefill_queue_p90_s)
    assert math.isnan(o.output_tokens) and math.isnan(o.prompt_tokens)
    assert o.kv_used_fraction == 0.0  # no pool reported
    empty = observe("prefill", 5.0, {}, {})
    assert (empty.instances, empty.arrivals_per_s) == (0, 0.0)
    assert math.isnan(empty.ttft_p90_s)
    # an interval of 0 s (the first one) has no rate
    assert observe("decode", 0.0, same, {}).arrivals_per_s == 0.0


def test_observe_prompt_tokens_per_arrival():
    old = {"a": Scrape({"requests_total": 0, "prefix_cache_query_tokens_total": 1000})}
    new = {"a": Scrape({"requests_total": 4, "requests_active": 0, "prefix_cache_query_tokens_total": 2024})}
    o = observe("decode", 1.0, new, old)
    assert o.prompt_tokens == pytest.approx(1024 / 4)


def test_bucket_delta_falls_back_to_the_new_counts_when_the_layout_changed():
    new = [(0.1, 5.0), (math.inf, 8.0)]
    assert bucket_delta(new, [(0.1, 2.0), (math.inf, 3.0)]) == [(0.1, 3.0), (math.inf, 5.0)]
    assert bucket_delta(new, None) == new
    assert bucket_delta(new, [(0.2, 1.0), (math.inf, 1.0)]) == new  # other bounds
    assert bucket_delta(new, [(0.1, 1.0), (0.5, 1.0), (math.inf, 1.0)]) == new  # other count of buckets
    assert bucket_delta(new, [(0.1, 9.0), (math.inf, 9.0)]) == new  # went down: restarted
