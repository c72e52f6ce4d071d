"""``triton-disagg drain INSTANCE``: take one instance of a running deployment out without
failing a request. The instance is found in the deployment's membership (etcd) by its record
name or its Triton model name; a drain request signed with the deployment secret goes to its
drain key in the same etcd (``backend/serving/drain.py``), apart from the models' inputs; the
drain is confirmed when its record says ``draining`` (or it left)."""

from __future__ import annotations

import logging
import time

from backend.cluster.etcd import EtcdClient
from backend.cluster.records import BadRecord, InstanceRecord, decode, prefix_of
from backend.serving.drain import drain_key, drain_request

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


def drain(discovery: str, record: InstanceRecord, secret: bytes, timeout_s: float = 15.0) -> None:
    """Write the drain request at the instance's drain key and wait until its record says it
    drains (or is gone); raise RuntimeError when it does not within ``timeout_s`` (the request
    was refused, which the instance logs, or the instance does not watch its key)."""
    client = EtcdClient(discovery)
    key = drain_key(record.deployment, record.name)
    client.put(key, drain_request(secret, record.name).encode())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = {r.name: r for r in members(discovery, record.deployment, secret)}
        if record.name not in now or now[record.name].draining:
            return
        time.sleep(0.2)
    _, left = client.get_prefix(key)
    client.delete(key)
    why = "it did not read it (no watcher)" if left else "it refused the request (see its server's log)"
    raise RuntimeError(f"instance {record.name} did not drain within {timeout_s:g}s: {why}")
