"""What the autoscaler reads from a deployment: each instance's Prometheus metrics (its server's
``metrics_url`` from its membership record, series of its own ``model``), turned into one
:class:`Observation` per role and interval.

Counters and histograms are cumulative, so an interval's figures are differences between two
scrapes: arrivals (requests finished plus the change of requests in flight), tokens per request,
and quantiles of the TTFT, inter-token and prefill-queue histograms over just that interval
(Prometheus' ``histogram_quantile`` interpolation within a bucket). An instance that joined or
restarted during the interval (a counter went down) counts from zero.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import requests

from backend.cluster.prometheus_text import samples

PREFIX = "triton_disagg_"


@dataclass
class Scrape:
    """One instance's ``triton_disagg_*`` series at one time: plain values by name, histogram
    buckets by name as ``[(le, cumulative count)]`` sorted by ``le``."""

    values: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


def parse(text: str, model: str) -> Scrape:
    """The series of ``model`` (label ``model``) in Prometheus text, summed over other labels."""
    values: dict[str, float] = defaultdict(float)
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for (full, label_set), value in samples(text).items():
        if not full.startswith(PREFIX):
            continue
        labels = dict(label_set)
        if labels.get("model") != model:
            continue
        name = full[len(PREFIX) :]
        if name.endswith("_bucket") and "le" in labels:
            buckets[name[: -len("_bucket")]][float(labels["le"])] += value
        else:
            values[name] += value
    return Scrape(dict(values), {k: sorted(v.items()) for k, v in buckets.items()})


def scrape(metrics_url: str, models: list[str], timeout_s: float = 2.0) -> dict[str, Scrape]:
    """Each of ``models`` as served at ``metrics_url`` (one HTTP read for all of them)."""
    text = requests.get(metrics_url, timeout=timeout_s).text
    return {m: parse(text, m) for m in models}


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """The ``q`` quantile (0..1) of cumulative ``buckets`` (Prometheus' interpolation); NaN when
    empty. A quantile in the ``+Inf`` bucket is the highest finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def _delta(new: float, old: float | None) -> float:
    """A counter's increase; a counter that went down restarted from zero."""
    if old is None or new < old:
        return new
    return new - old


def bucket_delta(new: list[tuple[float, float]], old: list[tuple[float, float]] | None) -> list[tuple[float, float]]:
    if not old or len(old) != len(new) or any(a[0] != b[0] for a, b in zip(new, old)) or new[-1][1] < old[-1][1]:
        return list(new)
    return [(le, c - o) for (le, c), (_, o) in zip(new, old)]


@dataclass(frozen=True)
class Observation:
    """One role's figures over one interval (NaN: no request in it to measure)."""

    role: str
    instances: int
    interval_s: float
    arrivals_per_s: float = 0.0
    prompt_tokens: float = math.nan  # mean per request that arrived
    output_tokens: float = math.nan  # mean per request that finished
    ttft_p90_s: float = math.nan
    itl_p90_s: float = math.nan
    prefill_queue_p90_s: float = math.nan
    requests_active: float = 0.0
    requests_waiting_kv: float = 0.0
    prefill_queue_depth: float = 0.0
    kv_used_fraction: float = 0.0
    failed: float = 0.0  # requests that ended with an error in the interval


def observe(role: str, interval_s: float, new: dict[str, Scrape], old: dict[str, Scrape]) -> Observation:
    """The role's observation from its instances' scrapes now (``new``) and one interval ago
    (``old``), both keyed by instance name."""

    def total(name: str) -> float:
        return sum(
            _delta(s.values.get(name, 0.0), old[k].values.get(name) if k in old else None) for k, s in new.items()
        )

    def now(name: str) -> float:
        return sum(s.values.get(name, 0.0) for s in new.values())

    def quantile(name: str, q: float = 0.9) -> float:
        merged: dict[float, float] = defaultdict(float)
        for k, s in new.items():
            if name not in s.buckets:
                continue
            prev = old[k].buckets.get(name) if k in old else None
            for le, c in bucket_delta(s.buckets[name], prev):
                merged[le] += c
        return histogram_quantile(q, sorted(merged.items()))

    finished = total("requests_total")
    active_before = sum(old[k].values.get("requests_active", 0.0) for k in new if k in old)
    arrivals = max(0.0, finished + now("requests_active") - active_before)
    query = total("prefix_cache_query_tokens_total")
    pages = now("kv_pages_total")
    return Observation(
        role=role,
        instances=len(new),
        interval_s=interval_s,
        arrivals_per_s=arrivals / interval_s if interval_s > 0 else 0.0,
        prompt_tokens=query / arrivals if arrivals and query else math.nan,
        output_tokens=total("output_tokens_total") / finished if finished else math.nan,
        ttft_p90_s=quantile("time_to_first_token_seconds"),
        itl_p90_s=quantile("inter_token_latency_seconds"),
        prefill_queue_p90_s=quantile("prefill_queue_time_seconds"),
        requests_active=now("requests_active"),
        requests_waiting_kv=now("requests_waiting_kv"),
        prefill_queue_depth=now("prefill_queue_depth"),
        kv_used_fraction=now("kv_pages_used") / pages if pages else 0.0,
        failed=total("requests_failed_total"),
    )
