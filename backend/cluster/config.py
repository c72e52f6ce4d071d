"""The deployment settings of an instance (``MembershipConfig``): where its deployment's etcd
is, the deployment's name, the lease and grace of its records, the deployment secret's file and
where its trace spans go; parsed once by ``backend/serving/config.py`` like every other section."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MembershipConfig:
    """``discovery`` (``etcd://HOST:PORT``): the deployment's etcd, where every prefill and
    decode instance registers under ``/triton-disagg/<deployment>/`` with a lease of
    ``membership_ttl_s`` that it keeps alive, and where decode instances find the prefill
    instances (then the connector's ``prefill_endpoints`` is not used); empty: the fixed
    ``prefill_endpoints``. ``membership_grace_s``: after an etcd outage, how long a member
    missing from etcd stays before it is dropped (live instances register again within it).
    ``state_interval_s``: how often a decode instance looks at its health and cache summary and,
    when they changed, writes them into its record (what routers route by).
    ``deployment_secret_file``: the deployment secret, which signs the membership records,
    drain requests and the agents' API and which KV messenger peers prove (default: the
    environment variable ``TRITON_DISAGG_DEPLOYMENT_SECRET``; see ``backend/disagg/auth.py``).
    ``otlp_endpoint`` (``http://HOST:PORT``): the OpenTelemetry collector every process of the
    deployment exports its trace spans to (OTLP/HTTP, ``backend/cluster/tracing.py``); empty:
    no tracing."""

    discovery: str = ""
    deployment: str = "default"
    membership_ttl_s: float = 5.0
    membership_grace_s: float = 10.0
    deployment_secret_file: str = ""
    state_interval_s: float = 1.0
    otlp_endpoint: str = ""

    def __post_init__(self) -> None:
        if self.membership_ttl_s < 1:
            raise ValueError(
                f"membership_ttl_s must be >= 1 (etcd leases count whole seconds), got {self.membership_ttl_s}"
            )
        if self.membership_grace_s <= 0:
            raise ValueError(f"membership_grace_s must be > 0, got {self.membership_grace_s}")
        if self.state_interval_s <= 0:
            raise ValueError(f"state_interval_s must be > 0, got {self.state_interval_s}")
        if self.discovery:
            scheme, sep, rest = self.discovery.partition("://")
            host, colon, port = rest.rpartition(":")
            if scheme not in ("etcd", "http") or not sep or not host or not port.isdigit():
                raise ValueError(f"discovery {self.discovery!r} must be etcd://HOST:PORT")
        if self.otlp_endpoint and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ValueError(f"otlp_endpoint {self.otlp_endpoint!r} must be http://HOST:PORT (OTLP over HTTP)")
        if not self.deployment or "/" in self.deployment:
            raise ValueError(f"deployment {self.deployment!r} must be a non-empty name without '/'")

    def etcd_host(self) -> str:
        """The host of the deployment's etcd (empty without ``discovery``)."""
        return self.discovery.partition("://")[2].rpartition(":")[0]
