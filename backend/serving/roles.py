"""Which worker serves a client-facing role: ``aggregated`` or ``decode`` (a prefill instance is
fed over the messenger and has its own Triton model)."""

from __future__ import annotations

from backend.serving.aggregated_worker import AggregatedWorker
from backend.serving.config import InstanceConfig
from backend.serving.decode_worker import DecodeWorker
from backend.serving.worker import Worker


def make_worker(config: InstanceConfig, name: str, model: str = "") -> Worker:
    """The client-facing worker of a role (the prefill role has no client-facing worker);
    ``model``: the Triton model it serves (a decode instance registers under it)."""
    if config.role == "aggregated":
        return AggregatedWorker(config, name)
    if config.role == "decode":
        return DecodeWorker(config, name, model)
    raise ValueError(f"role {config.role!r} has no client-facing worker; expected one of ['aggregated', 'decode']")
