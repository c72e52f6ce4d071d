"""``triton-disagg drain INSTANCE``: take one instance of a running deployment out without
failing a request. The instance is found in the deployment's membership (etcd) by its record
name or its Triton model name; its model gets a ``drain_request`` signed with the deployment
secret (``backend/serving/drain.py``) through its server's gRPC API."""

from __future__ import annotations

import logging
import queue

import numpy as np

from backend.cluster.etcd import EtcdClient
from backend.cluster.records import BadRecord, InstanceRecord, decode, prefix_of
from backend.serving.drain import drain_request

log = logging.getLogger("triton_disagg.drain")


def members(discovery: str, deployment: str, secret: bytes) -> list[InstanceRecord]:
    """The verified records of the deployment (a record that fails verification is logged)."""
    _, kvs = EtcdClient(discovery).get_prefix(prefix_of(deployment))
    out = []
    for key, raw in sorted(kvs.items()):
        try:
            out.append(decode(raw, secret, key))
        except BadRecord as e:
            log.warning("ignoring the record at %s: %s", key, e.reason)
    return out


def find(records: list[InstanceRecord], instance: str) -> InstanceRecord:
    """The one record named ``instance`` (its record name, or its model name when unique)."""
    by_name = [r for r in records if r.name == instance]
    matches = by_name or [r for r in records if r.model == instance]
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(f"{r.name} ({r.role} {r.model} at {r.grpc_url})" for r in records) or "none"
    if not matches:
        raise LookupError(f"no instance {instance!r} in the membership; known: {known}")
    raise LookupError(f"{instance!r} names {len(matches)} instances; give one of their names: {known}")


def drain(record: InstanceRecord, secret: bytes, timeout_s: float = 30.0) -> None:
    """Send the drain request to the instance's model; raise RuntimeError with its refusal."""
    import tritonclient.grpc as grpcclient

    if not record.grpc_url:
        raise RuntimeError(f"instance {record.name} registered no gRPC address")
    arr = np.array([drain_request(secret, record.name).encode()], dtype=object)
    tensor = grpcclient.InferInput("drain_request", [1], "BYTES")
    tensor.set_data_from_numpy(arr)
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(record.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: answers.put(error))
        client.async_stream_infer(record.model, [tensor], enable_empty_final_response=True)
        error = answers.get(timeout=timeout_s)
    finally:
        client.stop_stream()
        client.close()
    if error is not None:
        raise RuntimeError(f"instance {record.name}: {error.message() if hasattr(error, 'message') else error}")
