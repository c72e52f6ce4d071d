"""How a disaggregated worker takes part in its deployment's membership
(``backend/cluster/``): its own signed record under a lease (:func:`register`), and, for a
decode worker, the prefill instances it may use (:class:`PrefillDirectory`).

With the membership's ``discovery`` set (``etcd://HOST:PORT``, ``backend/cluster/config.py``)
both go through etcd under the deployment's prefix; without it a decode worker's prefill
instances are the connector's fixed ``prefill_endpoints`` list, handed
to the worker once, as the same "joined" event: the worker has one code path. A record is
accepted only if its model identity and KV layout are this instance's (:func:`identity`);
records that fail verification or acceptance are logged by name and never reach routing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backend.cluster.etcd import EtcdClient
from backend.cluster.membership import Membership, Registration
from backend.cluster.records import InstanceRecord
from backend.engine.protocol import ModelDims
from backend.serving.config import InstanceConfig

log = logging.getLogger("triton_disagg.discovery")
GRPC_URL_ENV = "TRITON_DISAGG_GRPC_URL"  # set by the launcher: the gRPC address of this Triton server
METRICS_URL_ENV = "TRITON_DISAGG_METRICS_URL"  # set by the launcher: its Prometheus endpoint (for autoscalers)

OnChange = Callable[[list[InstanceRecord], list[InstanceRecord]], None]


def identity(config: InstanceConfig, dims: ModelDims) -> tuple[str, str]:
    """(model identity, KV layout identity) of this instance: instances of one deployment must
    agree on both (TP sizes may differ: the transfer plan maps head slices)."""
    e = config.engine
    cfg = Path(e.model_path) / "config.json"
    digest = hashlib.sha256(cfg.read_bytes() if cfg.is_file() else e.model_path.encode()).hexdigest()[:16]
    model = f"{digest}:{e.weights_dtype or e.dtype}"
    layout = f"L{dims.num_layers}-H{dims.num_kv_heads}-D{dims.head_dim}-P{e.page_size}-{e.kv_dtype or e.dtype}"
    return model, layout


def instance_name(model: str) -> str:
    return f"{socket.gethostname()}-{model}-{os.getpid()}"


def register(
    config: InstanceConfig,
    secret: bytes,
    dims: ModelDims,
    role: str,
    model: str,
    messenger: str = "",
    state: Callable[[], dict[str, Any]] | None = None,
) -> Registration | None:
    """Register this instance in etcd (None without ``discovery``); the lease is kept alive by
    the registration's thread, and ``close()`` deregisters. ``state()``: record fields the
    instance keeps current (a decode instance's ``health`` and ``cache``), in the first record
    and written again when they changed: a changed ``health`` at once, the rest at most every
    ``state_interval_s``."""
    c = config.membership
    if not c.discovery:
        return None
    model_identity, layout = identity(config, dims)
    record = InstanceRecord(
        deployment=c.deployment,
        name=instance_name(model),
        role=role,
        grpc_url=os.environ.get(GRPC_URL_ENV, ""),
        model=model,
        messenger=messenger,
        model_identity=model_identity,
        kv_layout=layout,
        tp_size=config.engine.tensor_parallel_size,
        started_at=time.time(),
        metrics_url=os.environ.get(METRICS_URL_ENV, ""),
    )
    if state is not None:
        record = dataclasses.replace(record, **state())
    reg = Registration(EtcdClient(c.discovery), record, secret, ttl_s=c.membership_ttl_s).start()
    if state is not None:
        reg.follow(state, c.state_interval_s, at_once=("health",))
    log.info("%s %s registers in %s (deployment %r) as %s", role, model, c.discovery, c.deployment, reg.key)
    return reg


class PrefillDirectory:
    """The prefill instances a decode worker may use; ``on_change(joined, left)`` (any thread)
    gets the records as they join and leave (a record that now says ``draining`` comes as joined
    again)."""

    def __init__(self, config: InstanceConfig, secret: bytes, dims: ModelDims, on_change: OnChange):
        c = config.membership
        self._own = identity(config, dims)
        self._membership: Membership | None = None
        if c.discovery:
            self._membership = Membership(
                EtcdClient(c.discovery),
                c.deployment,
                secret,
                role="prefill",
                accept=self._accept,
                on_change=on_change,
                grace_s=c.membership_grace_s,
            )
            self.source = f"etcd {c.discovery} (deployment {c.deployment!r})"
        else:
            model_identity, layout = self._own
            fixed = config.connector
            records = [
                InstanceRecord(c.deployment, f"{h}:{p}", "prefill", "", "", f"{h}:{p}", model_identity, layout, 1, 0.0)
                for h, p in fixed.endpoints()
            ]
            self.source = f"prefill_endpoints {fixed.prefill_endpoints}"
            on_change(records, [])

    def _accept(self, record: InstanceRecord) -> str | None:
        model_identity, layout = self._own
        if record.model_identity != model_identity:
            return f"model identity {record.model_identity} is not this instance's {model_identity}"
        if record.kv_layout != layout:
            return f"KV layout {record.kv_layout} is not this instance's {layout}"
        host, sep, port = record.messenger.rpartition(":")
        if not sep or not host or not port.isdigit():
            return f"messenger address {record.messenger!r} is not host:port"
        return None

    @property
    def connected(self) -> bool:
        """Whether the membership source answers (a static list always does)."""
        return self._membership is None or self._membership.connected

    def close(self) -> None:
        if self._membership is not None:
            self._membership.close()
