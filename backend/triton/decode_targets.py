"""The front model's decode targets: the shared membership watcher and readiness probes
(``backend/serving/target_watch.py``) over the routing core (``backend/serving/routing.py``),
both shared with the OpenAI frontend, with the front model's links and its gauges.

Which: the fixed ``decode_models`` of this server, or, when that is empty, every decode instance
of the deployment's membership, reached over gRPC wherever the server's address is known
(``TRITON_DISAGG_GRPC_URL``, set by the launcher), so a client of this server's Triton API reaches
the decode instances of every server, and its streams move off a server that dies; by BLS
(``backend/triton/decode_link.py``) only for this server's decode models when its address is
unknown (a repository started without the launcher). A decode model's responses to a BLS caller
whose stub died block its sending thread for good (the decode instance stops), while a gRPC stream
whose client is gone is cancelled.

One reached by BLS is taken as ready (its probe is not sent). The requests in flight on a target
that goes down or leaves go to ``on_lost``, which moves them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from backend.disagg.auth import load_secret
from backend.serving.config import FrontConfig
from backend.serving.decode_stream import DecodeLink, GrpcLink
from backend.serving.discovery import GRPC_URL_ENV
from backend.serving.routing import Journey, RoutingTable, Target
from backend.serving.target_watch import TargetWatch
from backend.serving.tensors import OUTPUTS
from backend.triton.decode_link import BlsLink

log = logging.getLogger("triton_disagg.front")
LISTING_WAIT_S = 5.0  # how long the front's start waits for the membership's first listing


class DecodeTargets(TargetWatch):
    """The shared watcher over the front's decode targets (``table``), their links and probes;
    ``on_lost(name, reason, requests)`` runs when a target goes down or leaves with the requests
    it had."""

    def __init__(self, pb_utils, config: FrontConfig, on_lost: Callable[[str, str, list[Journey]], None]):
        self.pb, self.config = pb_utils, config
        self._outputs = [o.name for o in OUTPUTS]
        table = RoutingTable(config, log, noun="decode model" if config.targets() else "decode instance")
        super().__init__(
            table, self._make_link, on_lost, fixed=config.targets(), own_url=os.environ.get(GRPC_URL_ENV, "")
        )

    @property
    def spans_servers(self) -> bool:
        """True when the targets are the membership's decode instances (no fixed list)."""
        return not self.fixed

    def start(self) -> None:
        """Follow the membership and begin probing. Call it when the front model's ``initialize``
        is done."""
        c = self.config.membership
        if c.discovery:
            self.follow(
                c.discovery,
                c.deployment,
                load_secret(c.deployment_secret_file),
                grace_s=c.membership_grace_s,
                wait_s=LISTING_WAIT_S,
            )
        if self.spans_servers:
            log.info(
                "routing across the decode instances of deployment %r in %s (this server: %s)",
                c.deployment,
                c.discovery,
                self.own_url or "its address unknown: every instance over gRPC",
            )
        self.start_probing(first_delay_s=self.config.health_probe_interval_s)

    def _make_link(self, target: Target) -> DecodeLink:
        """gRPC wherever the target's server address is known, this server's too; BLS only for
        this server's decode models when its address is unknown."""
        if not target.grpc_url:
            return BlsLink(self.pb, target, self._outputs)
        return GrpcLink(target, self.config.health_probe_timeout_s)

    def gauges(self) -> dict[tuple[str, str], float]:
        """(decode model, gRPC address; "" for this server's) -> 1 while the front routes new
        requests to an instance there, else 0. Keyed by where, not by instance: a reloaded stub
        (a new instance, a new record) is the same decode model again."""
        out: dict[tuple[str, str], float] = {}
        for s in self.table.status():
            where = self.table.target(s.name)
            if where is not None:
                url = "" if where.grpc_url == self.own_url else where.grpc_url
                key = (where.model, url)
                out[key] = max(out.get(key, 0.0), float(s.serving))
        return out
