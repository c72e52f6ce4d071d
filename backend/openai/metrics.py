"""The frontend's ``GET /metrics``: Prometheus text of its router, written by ``prometheus_client``
(``backend/cluster/prometheus_text.py``).

- ``triton_disagg_migrations_total{reason}``: requests moved to another decode instance
  (``instance_down``: its probes failed or it left the membership; ``stream_error``: its stream
  failed or stopped before the end); always 0 without ``--discovery`` (one target).
- ``triton_disagg_decode_target_up{target, grpc_url, model}``: 1 while the frontend routes new
  requests to that decode instance (probes pass, not draining).
- ``triton_disagg_requests_routed_total{target, grpc_url, model}``: requests (and moves) sent there.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from backend.cluster.prometheus_text import CONTENT_TYPE
from backend.cluster.prometheus_text import exposition as _text
from backend.openai.router import Router, Target
from backend.serving.routing import REASONS

__all__ = ["CONTENT_TYPE", "exposition"]
TARGET_LABELS = ["target", "grpc_url", "model"]


def exposition(router: Router | None) -> str:
    """The metrics text; ``router`` None (no discovery): the migration counters at 0."""
    moved = router.migrations if router is not None else {}
    migrations = CounterMetricFamily(
        "triton_disagg_migrations",
        "requests the frontend moved to another decode instance, by reason",
        labels=["reason"],
    )
    for reason in REASONS:
        migrations.add_metric([reason], float(moved.get(reason, 0)))
    families: list[Metric] = [migrations]
    if router is not None:
        status = router.status()

        def labels(t: Target) -> list[str]:
            return [t.name, t.grpc_url, t.model]

        up = GaugeMetricFamily(
            "triton_disagg_decode_target_up",
            "1 while the frontend routes new requests to this decode instance",
            labels=TARGET_LABELS,
        )
        routed = CounterMetricFamily(
            "triton_disagg_requests_routed",
            "requests (first attempts and moves) the frontend sent to this decode instance",
            labels=TARGET_LABELS,
        )
        for t, s in status:
            up.add_metric(labels(t), float(s.serving))
            routed.add_metric(labels(t), float(s.routed))
        families += [up, routed]
    return _text(families)
