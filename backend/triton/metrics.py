"""Triton custom metrics (``pb_utils.MetricFamily``) of one model instance, on the metrics port.

A small background thread refreshes gauges from a ``stats()`` callable and advances counters
that ``stats()`` reports as running totals; the serving code bumps the others with ``add``.
Names start with ``triton_disagg_``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("triton_disagg.metrics")

GAUGES = {
    "kv_pages_total": "KV cache pages in this instance's pool",
    "kv_pages_free": "KV cache pages free in this instance's pool",
    "kv_pages_used": "KV cache pages held by requests in this instance",
    "requests_active": "requests admitted and not finished in this instance",
    "requests_waiting_kv": "decode requests waiting for their KV transfer to complete",
    "prefill_queue_depth": "prefill requests queued or running in this instance",
    "prefill_endpoints_connected": "decode instance: prefill instances its KV messenger is connected to",
}
COUNTERS = {
    "requests_total": "requests finished, any outcome",
    "requests_failed_total": "requests that ended with an error",
    "output_tokens_total": "tokens generated",
    "ttft_seconds_total": "sum of time to first token over finished requests",
    "kv_transfer_seconds_total": "sum of KV transfer time over requests",
    "kv_transfer_bytes_total": "KV bytes transferred",
    "kv_writes_total": "KV page writes posted or received",
    "prefill_compute_seconds_total": "prefill instance: time from request arrival to its last chunk computed",
    "kv_transfer_tail_seconds_total": "prefill instance: time from last chunk computed to all KV writes done",
    "prefills_total": "prefill instance: prefills finished (sent or failed)",
    "kv_posts_deferred_total": "prefill instance: KV posts that waited for the device to execute the write (0 on CPU)",
}


class InstanceMetrics:
    def __init__(self, pb_utils, labels: dict, stats: Callable[[], dict], period_s: float = 0.25):
        self._families = []
        self.gauges, self.counters = {}, {}
        for table, kind, store in (
            (GAUGES, pb_utils.MetricFamily.GAUGE, self.gauges),
            (COUNTERS, pb_utils.MetricFamily.COUNTER, self.counters),
        ):
            for name, desc in table.items():
                fam = pb_utils.MetricFamily(name=f"triton_disagg_{name}", description=desc, kind=kind)
                self._families.append(fam)
                store[name] = fam.Metric(labels=labels)
        self._stats = stats
        self._last_totals: dict[str, float] = {}
        self._period = period_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._refresh_loop, name="metrics", daemon=True)
        self._thread.start()

    def add(self, name: str, value: float) -> None:
        with self._lock:
            self.counters[name].increment(float(value))

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self._period):
            try:
                stats = self._stats()
                with self._lock:
                    for k, v in stats.items():
                        if k in self.gauges:
                            self.gauges[k].set(float(v))
                        elif k in self.counters and v > self._last_totals.get(k, 0.0):
                            self.counters[k].increment(float(v) - self._last_totals.get(k, 0.0))
                            self._last_totals[k] = float(v)
            except Exception as e:  # metrics must never take serving down
                log.debug("metrics refresh failed: %s", e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.gauges.clear()
        self.counters.clear()
        self._families.clear()
