"""Triton custom metrics (``pb_utils.MetricFamily``) of one model instance, on the metrics port.

A small background thread refreshes gauges from a ``stats()`` callable (the worker's typed stats,
``backend/serving/stats.py``: one field per metric) and advances counters that ``stats()`` reports
as running totals; the model bumps the others (``RequestTotals``) with ``add``. Every stat field has
a metric here and every metric a field (a unit test checks it); a name without a metric is logged as
an error, never dropped silently.
Histograms (latencies, in seconds) take single observations: ``observe`` from the model, and
whatever the worker's ``observations()`` hands over at each refresh. Names start with
``triton_disagg_``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from backend.serving.stats import InstanceStats

log = logging.getLogger("triton_disagg.metrics")

GAUGES = {
    "kv_pages_total": "KV cache pages in this instance's pool",
    "kv_pages_free": "KV cache pages free in this instance's pool (unused cached pages count as free)",
    "prefix_cache_cached_pages": "full KV pages in the prefix cache (held by requests or evictable)",
    "kv_pages_used": "KV cache pages held by requests in this instance",
    "requests_active": "requests admitted and not finished in this instance",
    "requests_waiting_kv": "decode requests waiting for their KV transfer to complete",
    "prefill_queue_depth": "prefill requests queued or running in this instance",
    "prefill_endpoints_connected": "decode instance: prefill instances its KV messenger is connected to",
    "kv_tier_host_blocks": "KV blocks (a page, every layer) in this instance's host tier",
    "kv_tier_disk_blocks": "KV blocks in the disk tier that this instance knows",
    "kv_tier_disk_bytes": "bytes of the disk tier's block files that this instance knows",
    "kv_tier_shared_up": "1 while the shared KV tier's store answers (0: down, or no shared tier)",
    "kv_tier_block_bytes": "bytes of one KV block (a page, every layer): a tier's bytes are its blocks times this",
}
COUNTERS = {
    "requests_total": "requests finished, any outcome",
    "trace_spans_dropped_total": "trace spans not exported (the collector unreachable or slow, or its queue full)",
    "requests_failed_total": "requests that ended with an error",
    "output_tokens_total": "tokens generated",
    "ttft_seconds_total": "sum of time to first token over finished requests",
    "kv_transfer_seconds_total": "sum of KV transfer time over requests",
    "kv_transfer_bytes_total": "KV bytes transferred",
    "kv_writes_total": "KV page writes posted or received",
    "prefill_compute_seconds_total": "prefill instance: time from request arrival to its last chunk computed",
    "kv_transfer_tail_seconds_total": "prefill instance: time from last chunk computed to all KV writes done",
    "prefills_total": "prefill instance: prefills finished (sent or failed)",
    "prefix_cache_query_tokens_total": "prompt tokens looked up in the prefix cache",
    "prefill_local_total": "decode instance: requests prefilled here (short uncached part, or a failed KV load)",
    "prefill_remote_total": "decode instance: requests sent to a prefill instance",
    "kv_loads_recomputed_total": "decode instance: failed KV loads computed again (elsewhere or here)",
    "prefix_cache_hit_tokens_total": "prompt tokens found in the prefix cache (their KV not recomputed)",
    "prefix_cache_evictions_total": "cached pages evicted to make room",
    "kv_tier_hit_tokens_total": "prompt tokens whose KV was loaded from the host or disk tier (part of the hit tokens)",
    "kv_tier_host_hit_blocks_total": "KV blocks loaded from the host tier",
    "kv_tier_spilled_blocks_total": "cached pages evicted from the pool into the tiers",
    "kv_tier_disk_hit_blocks_total": "KV blocks loaded from the disk tier",
    "kv_tier_disk_writes_total": "KV blocks written to the disk tier",
    "kv_tier_disk_dropped_total": "KV blocks not written to the disk tier (writer queue full, or a write failed)",
    "kv_tier_disk_corrupt_total": "disk tier block files refused (damaged, or another model or layout) and removed",
    "kv_tier_disk_read_errors_total": "disk tier reads that failed (NIXL's: read again plainly; plain's: computed)",
    "kv_tier_load_failures_total": "tier loads that ended early (a block could not be read): the rest was computed",
    "kv_tier_load_seconds_total": "time the tier loader spent copying blocks into the pool",
    "kv_tier_host_load_seconds_total": "of the tier loader's time: copying host tier blocks into the pool",
    "kv_tier_disk_load_seconds_total": "of the tier loader's time: reading, checking and copying disk tier blocks",
    "kv_tier_shared_load_seconds_total": "of the tier loader's time: reading, checking and copying shared tier blocks",
    "kv_tier_host_miss_blocks_total": "blocks of a prompt past the pool's that the host tier was asked for and lacked",
    "kv_tier_disk_miss_blocks_total": "blocks past the pool's and the host tier's that the disk tier lacked",
    "kv_tier_shared_miss_blocks_total": "blocks past the private tiers' that the shared tier lacked (as far as known)",
    "kv_tier_host_evicted_blocks_total": "blocks the host tier pushed out (on to the disk tier when hit often enough)",
    "kv_tier_disk_evicted_blocks_total": "block files the disk tier removed to stay under kv_disk_bytes",
    "kv_tier_shared_hit_blocks_total": "KV blocks loaded from the shared tier",
    "kv_tier_shared_writes_total": "KV blocks written to the shared tier",
    "kv_tier_shared_dropped_total": "KV blocks not written to the shared tier (queue full, or the store down)",
    "kv_tier_shared_errors_total": "calls to the shared tier's store that failed or timed out",
    "kv_tier_shared_corrupt_total": "shared tier blocks refused (damaged, or another model or layout)",
    "kv_posts_deferred_total": "prefill instance: KV posts that waited for the device to execute the write (0 on CPU)",
}


_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_KV_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
HISTOGRAMS = {
    "time_to_first_token_seconds": ("time from a request's arrival to its first token", _TTFT_BUCKETS),
    "inter_token_latency_seconds": ("time between successive output tokens of a request", _ITL_BUCKETS),
    "e2e_request_latency_seconds": ("time from a request's arrival to its last response", _E2E_BUCKETS),
    "kv_transfer_time_seconds": (
        "decode instance: time from the prefill instance starting a request to its last KV write "
        "landing (the prefill's compute overlapped with the layer-by-layer transfer)",
        _KV_BUCKETS,
    ),
    "prefill_queue_time_seconds": (
        "decode instance: time a request waited in the prefill instance's queue before it started",
        _QUEUE_BUCKETS,
    ),
}


class InstanceMetrics:
    def __init__(
        self,
        pb_utils,
        labels: dict,
        stats: Callable[[], InstanceStats],
        period_s: float = 0.25,
        observations: Callable[[], dict[str, list[float]]] | None = None,
    ):
        self._families = []
        self.gauges: dict = {}
        self.counters: dict = {}
        self.histograms: dict = {}
        for table, kind, store in (
            (GAUGES, pb_utils.MetricFamily.GAUGE, self.gauges),
            (COUNTERS, pb_utils.MetricFamily.COUNTER, self.counters),
        ):
            for name, desc in table.items():
                fam = pb_utils.MetricFamily(name=f"triton_disagg_{name}", description=desc, kind=kind)
                self._families.append(fam)
                store[name] = fam.Metric(labels=labels)
        for name, (desc, buckets) in HISTOGRAMS.items():
            fam = pb_utils.MetricFamily(
                name=f"triton_disagg_{name}", description=desc, kind=pb_utils.MetricFamily.HISTOGRAM
            )
            self._families.append(fam)
            self.histograms[name] = fam.Metric(labels=labels, buckets=list(buckets))
        self._stats = stats
        self._observations = observations
        self._last_totals: dict[str, float] = {}
        self._last_gauges: dict[str, float] = {}  # each gauge's value as last set
        self._unknown: set[str] = set()
        self._period = period_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._refresh_loop, name="metrics", daemon=True)
        self._thread.start()

    def add(self, name: str, value: float) -> None:
        with self._lock:
            self.counters[name].increment(float(value))

    def observe(self, name: str, values) -> None:
        """One observation (a float) or several (a list) of histogram ``name``."""
        with self._lock:
            metric = self.histograms[name]
            for v in values if isinstance(values, list) else [values]:
                metric.observe(float(v))

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self._period):
            try:
                stats = self._stats().as_dict()
                with self._lock:
                    for k, v in stats.items():
                        if k in self.gauges:
                            # only a change is set: each set is a message to the server, and
                            # setting every gauge 4 times a second kept an idle stub busy
                            if self._last_gauges.get(k) != float(v):
                                self.gauges[k].set(float(v))
                                self._last_gauges[k] = float(v)
                        elif k in self.counters:
                            if v > self._last_totals.get(k, 0.0):
                                self.counters[k].increment(float(v) - self._last_totals.get(k, 0.0))
                                self._last_totals[k] = float(v)
                        elif k not in self._unknown:
                            self._unknown.add(k)
                            log.error("stat %r has no metric: add it to GAUGES or COUNTERS", k)
                if self._observations is not None:
                    for name, values in self._observations().items():
                        self.observe(name, values)
            except Exception as e:  # metrics must never take serving down
                log.debug("metrics refresh failed: %s", e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.gauges.clear()
        self.counters.clear()
        self.histograms.clear()
        self._families.clear()
