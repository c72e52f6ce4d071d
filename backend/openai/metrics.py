"""The frontend's ``GET /metrics``: Prometheus text exposition (format 0.0.4) of its router.

- ``triton_disagg_migrations_total{reason}``: requests moved to another decode instance
  (``instance_down``: its probes failed or it left the membership; ``stream_error``: its stream
  failed or stopped before the end); always 0 without ``--discovery`` (one target).
- ``triton_disagg_decode_target_up{target, grpc_url, model}``: 1 while the frontend routes new
  requests to that decode instance (probes pass, not draining).
- ``triton_disagg_requests_routed_total{target, grpc_url, model}``: requests (and moves) sent there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from backend.openai.router import Router, Target
from backend.serving.routing import REASONS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Sample = tuple[Mapping[str, str], float]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _family(name: str, kind: str, help_: str, samples: Iterable[Sample]) -> list[str]:
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        number = str(int(value)) if value.is_integer() else repr(value)
        lines.append(f"{name}{{{inner}}} {number}" if inner else f"{name} {number}")
    return lines


def exposition(router: Router | None) -> str:
    """The metrics text; ``router`` None (no discovery): the migration counters at 0."""
    moved = router.migrations if router is not None else {}
    lines = _family(
        "triton_disagg_migrations_total",
        "counter",
        "requests the frontend moved to another decode instance, by reason",
        [({"reason": r}, float(moved.get(r, 0))) for r in REASONS],
    )
    if router is not None:
        status = router.status()

        def labels(t: Target) -> dict[str, str]:
            return {"target": t.name, "grpc_url": t.grpc_url, "model": t.model}

        lines += _family(
            "triton_disagg_decode_target_up",
            "gauge",
            "1 while the frontend routes new requests to this decode instance",
            [(labels(t), float(s.serving)) for t, s in status],
        )
        lines += _family(
            "triton_disagg_requests_routed_total",
            "counter",
            "requests (first attempts and moves) the frontend sent to this decode instance",
            [(labels(t), float(s.routed)) for t, s in status],
        )
    return "\n".join(lines) + "\n"
