"""The front model's decode targets as the routing core sees them (``backend/serving/routing.py``,
shared with the OpenAI frontend: health, the KV-aware pick, moves): which they are, how each is
reached (``backend/triton/decode_link.py``), what they say of themselves, and their probes.

Which: the fixed ``decode_models`` of this server, or, when that is empty, every decode instance
of the deployment's membership (``discovery``: a ``Membership(role="decode")``,
``backend/cluster/``; a record that fails verification is logged and never routed to), reached
over gRPC wherever the server's address is known (``TRITON_DISAGG_GRPC_URL``, set by the
launcher), so a client of this server's Triton API reaches the decode instances of every server,
and its streams move off a server that dies.

What they say of themselves comes in their membership records (whenever ``discovery`` is set;
for fixed decode models, the record of this server's instance serving each): draining, why one
cannot serve (no prefill instance connected, a lost tensor-parallel rank), its cache summary.

Every ``health_probe_interval_s`` (every 0.1 s while a target has never passed one) each target's
readiness is probed on its own thread, through Triton's own model readiness (gRPC ``ModelReady``;
one reached by BLS is taken as ready), never through the decode model's inputs. A probe that fails, or
stays unanswered for ``health_probe_timeout_s`` (a dead server), is a failure (an unanswered
one not while the target's streams deliver: :meth:`heard`, called per response relayed). The
core decides when a target is up or down; the requests in flight on one that goes down or
leaves go to ``on_lost``, which moves them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from backend.cluster.etcd import EtcdClient
from backend.cluster.membership import Membership
from backend.cluster.records import InstanceRecord, routable
from backend.disagg.auth import load_secret
from backend.serving.config import FrontConfig
from backend.serving.discovery import GRPC_URL_ENV
from backend.serving.routing import Journey, RoutingTable, Target
from backend.serving.tensors import OUTPUTS
from backend.triton.decode_link import BlsLink, DecodeLink, GrpcLink, Reply

log = logging.getLogger("triton_disagg.front")
LISTING_WAIT_S = 5.0  # how long the front's start waits for the membership's first listing


class DecodeTargets:
    """The routing core over the front's decode targets (``table``), their links and probes;
    ``on_lost(name, reason, requests)`` runs when a target goes down or leaves with the requests
    it had."""

    def __init__(self, pb_utils, config: FrontConfig, on_lost: Callable[[str, str, list[Journey]], None]):
        self.pb, self.config, self._on_lost = pb_utils, config, on_lost
        self.table = RoutingTable(config, log, noun="decode instance" if self.spans_servers else "decode model")
        for name in config.targets():
            self.table.join(name)
        self._own_url = os.environ.get(GRPC_URL_ENV, "")
        self._outputs = [o.name for o in OUTPUTS]
        self._links: dict[str, DecodeLink] = {}
        self._membership: Membership | None = None
        self._probing: dict[str, float] = {}  # name -> when its outstanding probe was sent
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe_loop, name="front-probes", daemon=True)

    @property
    def spans_servers(self) -> bool:
        """True when the targets are the membership's decode instances (no fixed list)."""
        return not self.config.targets()

    def start(self) -> None:
        """Follow the membership and begin probing. Call it when the front model's ``initialize``
        is done: a BLS call sent while the calling model still initializes took tritonserver
        down."""
        c = self.config.membership
        if c.discovery:
            self._membership = Membership(
                EtcdClient(c.discovery),
                c.deployment,
                load_secret(c.deployment_secret_file),
                role="decode",
                accept=routable if self.spans_servers else None,
                on_change=self._changed if self.spans_servers else self._reported,
                grace_s=c.membership_grace_s,
            )
            if not self._membership.wait_listed(LISTING_WAIT_S):
                log.warning("etcd at %s does not answer yet: no decode instance known", c.discovery)
        if self.spans_servers:
            log.info(
                "routing across the decode instances of deployment %r in %s (this server: %s)",
                c.deployment,
                c.discovery,
                self._own_url or "its address unknown: every instance over gRPC",
            )
        self._thread.start()

    def _changed(self, joined: list[InstanceRecord], left: list[InstanceRecord]) -> None:  # membership thread
        for name, why, lost in self.table.update(joined, left):
            if lost:
                self._on_lost(name, why, lost)

    def _reported(self, joined: list[InstanceRecord], left: list[InstanceRecord]) -> None:  # membership thread
        """Fixed decode models: what the records of this server's instances serving them say (a
        record that left changes nothing: a reloaded instance's new record follows)."""
        fixed = set(self.config.targets())
        for record in joined:
            if record.model in fixed and record.grpc_url == self._own_url:
                self.table.report(record.model, record)

    def link(self, name: str) -> DecodeLink | None:
        """How to reach target ``name`` (None once it left)."""
        target = self.table.target(name)
        if target is None:
            return None
        if not target.grpc_url and self._own_url:
            target = replace(target, grpc_url=self._own_url)  # a decode model of this server
        with self._lock:
            link = old = self._links.get(name)
            if link is None or link.target != target:
                link = self._links[name] = self._make_link(target)
        if old is not None and old is not link:
            old.close()  # its probe channel: the target moved
        return link

    def _make_link(self, target: Target) -> DecodeLink:
        """gRPC wherever the target's server address is known, this server's too: a decode
        model's responses to a BLS caller whose stub died block its sending thread for good (the
        decode instance stops), while a gRPC stream whose client is gone is cancelled; BLS only
        for this server's decode models when its address is unknown (a repository started
        without the launcher)."""
        if not target.grpc_url:
            return BlsLink(self.pb, target, self._outputs)
        return GrpcLink(target, self.config.health_probe_timeout_s)

    def heard(self, name: str) -> None:
        """A stream of ``name`` delivered a response (it is alive)."""
        self.table.heard(name)

    def failed(self, name: str, why: str) -> None:
        """A failed probe of ``name``, or a stream it ended that was not the request's fault."""
        lost = self.table.failed(name, why)
        if lost:
            self._on_lost(name, why, lost)

    # ------------------------------------------------------------ probes
    def _probe_loop(self) -> None:
        timeout = self.config.health_probe_timeout_s
        if self._stop.wait(self.config.health_probe_interval_s):  # let the front's initialize return
            return
        while True:
            now = time.monotonic()
            for name in self.table.names():
                with self._lock:
                    since = self._probing.setdefault(name, now)
                if since == now:
                    threading.Thread(target=self._probe, args=(name,), daemon=True).start()
                elif now - since > timeout:  # still unanswered: a failure per round until it returns
                    self._unanswered(name, f"readiness probe unanswered for {now - since:.0f}s")
            if self._stop.wait(self.table.probe_interval()):
                return

    def _unanswered(self, name: str, why: str) -> None:
        lost = self.table.probed(name, error=why, unanswered=True)
        if lost:
            self._on_lost(name, why, lost)

    def _probe(self, name: str) -> None:
        try:
            link = self.link(name)
            reply = link.probe() if link is not None else None
        except Exception as e:
            reply = Reply(error=f"{type(e).__name__}: {e}")
        with self._lock:
            self._probing.pop(name, None)
        if reply is None:
            return  # it left meanwhile
        if reply.error is not None and reply.unanswered:
            self._unanswered(name, reply.error)
        elif reply.error is not None:
            self.failed(name, reply.error)
        else:
            self.table.probed(name)

    def gauges(self) -> dict[tuple[str, str], float]:
        """(decode model, gRPC address; "" for this server's) -> 1 while the front routes new
        requests to an instance there, else 0. Keyed by where, not by instance: a reloaded stub
        (a new instance, a new record) is the same decode model again."""
        out: dict[tuple[str, str], float] = {}
        for s in self.table.status():
            where = self.table.target(s.name)
            if where is not None:
                url = "" if where.grpc_url == self._own_url else where.grpc_url
                key = (where.model, url)
                out[key] = max(out.get(key, 0.0), float(s.serving))
        return out

    def close(self) -> None:
        """Stop probing and following the membership, and close every link's probe channel
        (none is left to the stub's exit)."""
        self._stop.set()
        if self._membership is not None:
            self._membership.close()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
