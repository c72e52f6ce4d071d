"""Which worker serves a client-facing role: ``aggregated`` or ``decode`` (a prefill instance is
fed over the messenger and has its own Triton model)."""

from __future__ import annotations

from collections.abc import Callable

from backend.serving.aggregated_worker import AggregatedWorker
from backend.serving.config import InstanceConfig
from backend.serving.decode_worker import DecodeWorker
from backend.serving.worker import Worker


def make_worker(config: InstanceConfig, name: str) -> Worker:
    """The client-facing worker of a role (the prefill role has no client-facing worker)."""
    workers: dict[str, Callable[[InstanceConfig, str], Worker]] = {
        "aggregated": AggregatedWorker,
        "decode": DecodeWorker,
    }
    if config.role not in workers:
        raise ValueError(f"role {config.role!r} has no client-facing worker; expected one of {sorted(workers)}")
    return workers[config.role](config, name)
