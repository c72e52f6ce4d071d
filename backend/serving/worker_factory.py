"""Pick the worker behind a client-facing Triton model by its ``role`` parameter."""
from __future__ import annotations


def make_worker(role: str, model_path: str, params: dict, name: str):
    if role == "aggregated":
        from backend.serving.aggregated_worker import AggregatedWorker
        return AggregatedWorker(model_path, params, name)
    if role == "decode":
        from backend.serving.decode_worker import DecodeWorker
        return DecodeWorker(model_path, params, name)
    raise ValueError(f"unknown role {role!r} for a client-facing model; expected 'aggregated' or 'decode'")
