"""Settings of the KV connector of a disaggregated instance (prefill or decode role): the
fabric agent, the messenger and the transfer deadlines. An aggregated instance ignores them."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ConnectorConfig:
    """``prefill_endpoints`` (decode role): ``host:port,...`` of the prefill instances'
    messengers. ``messenger_host`` / ``messenger_port`` (prefill role): where this instance's
    messenger listens (port 0: any free port). ``stream_layers`` (prefill role): post each
    layer's pages as soon as the layer is written (false: everything after the prefill, for
    measuring the overlap). ``kv_transfer_timeout_s`` (decode role): once the prefill
    instance has started the request (it reports that), the longest time without a landed
    write (each layer of each prefill chunk lands as it is written, so a long prompt's prefill
    is not cut off while it makes progress; with ``stream_layers`` false the first write lands
    after the whole prefill, which this bound then covers);
    ``prefill_queue_timeout_s`` (decode role): how long the request may wait in the prefill
    instance's queue before that. ``prefill_connect_wait_s`` (decode role): how long a request
    that needs a prefill instance waits for one to connect (none connected) before it fails as
    ``prefill_unavailable``. ``kv_xfer_timeout_s``: one NIXL transfer stuck this long fails its request.
    ``kv_quarantine_s``: pages of a failed request are reused after this long at the latest
    (sooner when the sender confirms it stopped). ``meta_slots``: receive slots for the last
    hidden state and logits (requests in transfer at once). ``messenger_max_connections``
    (prefill role): decode instances connected at once. ``messenger_handshake_timeout_s``: the
    whole handshake's deadline (the secret peers prove is the membership's
    ``deployment_secret_file``, ``backend/cluster/config.py``). ``fabric_device``: the network
    device(s) NIXL's UCX transport may listen and send on (``UCX_NET_DEVICES``, e.g. ``eth0`` or
    ``mlx5_0:1``); ``auto``: loopback (``lo``) when every messenger address of this instance (with
    the membership's etcd: its address and this instance's messenger address) is a loopback
    address, else UCX's default (every device) unless the environment sets ``UCX_NET_DEVICES``;
    ``all``: UCX's default. ``cache_report_interval_s`` (prefill role): how often it reports its
    prefix cache and load to the connected decode instances.
    ``kv_routing_weight`` (decode role): picking a prefill instance, the weight of each prompt
    page not in its cache against each page of this instance's prefills queued there
    (``backend/serving/kv_router.py``; 0: least loaded)."""

    fabric_backend: str = "UCX"
    meta_slots: int = 64
    kv_quarantine_s: float = 12.0
    kv_xfer_timeout_s: float = 10.0
    kv_transfer_timeout_s: float = 20.0
    prefill_queue_timeout_s: float = 60.0
    prefill_connect_wait_s: float = 5.0
    prefill_endpoints: str = ""
    messenger_host: str = "127.0.0.1"
    messenger_port: int = 0
    messenger_advertise: str = ""
    stream_layers: bool = True
    messenger_max_connections: int = 64
    messenger_handshake_timeout_s: float = 10.0
    fabric_device: str = "auto"
    cache_report_interval_s: float = 0.5
    kv_routing_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.meta_slots < 1:
            raise ValueError(f"meta_slots must be >= 1, got {self.meta_slots}")
        if self.messenger_max_connections < 1:
            raise ValueError(f"messenger_max_connections must be >= 1, got {self.messenger_max_connections}")
        for name in (
            "kv_quarantine_s",
            "kv_xfer_timeout_s",
            "kv_transfer_timeout_s",
            "prefill_queue_timeout_s",
            "prefill_connect_wait_s",
            "messenger_handshake_timeout_s",
            "cache_report_interval_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.kv_routing_weight < 0:
            raise ValueError(f"kv_routing_weight must be >= 0, got {self.kv_routing_weight}")
        if not 0 <= self.messenger_port < 65536:
            raise ValueError(f"messenger_port must be in [0, 65535], got {self.messenger_port}")
        if self.prefill_endpoints:
            self.endpoints()  # validates the syntax

    def endpoints(self) -> list[tuple[str, int]]:
        """``prefill_endpoints`` as [(host, port), ...]; an error names a malformed entry."""
        out = []
        for item in filter(None, (s.strip() for s in self.prefill_endpoints.split(","))):
            host, sep, port = item.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"prefill endpoint {item!r} must be host:port")
            out.append((host, int(port)))
        if not out:
            raise ValueError("no prefill endpoints configured (parameter 'prefill_endpoints')")
        return out

    def net_devices(self, etcd_host: str = "") -> str | None:
        """The ``UCX_NET_DEVICES`` this instance's fabric agent uses; None: leave UCX's choice.
        ``etcd_host``: the deployment's etcd, when the membership finds the peers."""
        if self.fabric_device == "all":
            return None
        if self.fabric_device != "auto":
            return self.fabric_device
        if os.environ.get("UCX_NET_DEVICES"):
            return None  # the operator chose already
        if etcd_host:  # the peers are not known yet: local if the deployment's etcd is
            hosts = [etcd_host, self.messenger_host]
        elif self.prefill_endpoints:
            hosts = [h for h, _ in self.endpoints()]
        else:
            hosts = [self.messenger_host]
        return "lo" if all(_is_loopback(h) for h in hosts) else None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
