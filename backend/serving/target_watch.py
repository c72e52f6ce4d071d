"""The membership watcher and readiness probes of a front's decode targets, built once for both
fronts (the Triton front model, ``backend/triton/decode_targets.py``, and the OpenAI frontend,
``backend/openai/fleet.py``): it keeps a :class:`RoutingTable` current and hands the requests in
flight on a target that goes down or leaves to the front (``on_lost``), which moves them.

Which targets: a fixed list (the Triton front's ``decode_models``: what the membership records of
this server's instances serving them say is reported to the table), or, without one, every decode
instance of the deployment's membership (``Membership(role="decode")``, ``backend/cluster/``; a
record that fails verification is logged and never routed to).

Every ``health_probe_interval_s`` (every 0.1 s while a target has never passed one, and at once
when one joins) each target's readiness is probed on its own thread through its link
(``backend/serving/decode_stream.py``: Triton's own ``ModelReady``), never through the decode
model's inputs. A probe that fails, or stays unanswered for ``health_probe_timeout_s`` (a dead
server), is a failure (an unanswered one not while the target's streams deliver: :meth:`heard`,
called per response relayed). The table decides when a target is up or down.

It runs on threads of its own (the membership's, the probe loop, one per probe); what they learn
is handed to ``post`` (the Triton front: at once, on that thread; the OpenAI frontend: onto its
event loop), so the table's changes and ``on_lost`` run where the front routes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from backend.cluster.etcd import EtcdClient
from backend.cluster.membership import Membership
from backend.cluster.records import InstanceRecord, routable
from backend.serving.decode_stream import DecodeLink, Reply
from backend.serving.routing import Journey, RoutingTable, Target

# (target, why, the requests in flight there): a target went down or left under them
OnLost = Callable[[str, str, list[Journey]], None]
# runs a call where the front routes: post(fn, *args)
Post = Callable[..., None]


def call_now(fn: Callable[..., None], *args) -> None:
    fn(*args)


class TargetWatch:
    """``table``: the routing core's targets; ``make_link(target)``: how to reach one;
    ``own_url``: the gRPC address of the front's own server ("" unknown, or none), for a target
    without one (a fixed decode model of that server)."""

    def __init__(
        self,
        table: RoutingTable,
        make_link: Callable[[Target], DecodeLink],
        on_lost: OnLost,
        *,
        fixed: list[str] | None = None,
        own_url: str = "",
        post: Post = call_now,
    ):
        self.table, self.own_url = table, own_url
        self.fixed = list(fixed or [])
        self._make_link, self._on_lost, self.post = make_link, on_lost, post
        for name in self.fixed:
            table.join(name)
        self._links: dict[str, DecodeLink] = {}
        self._membership: Membership | None = None
        self._probing: dict[str, float] = {}  # name -> when its outstanding probe was sent
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def log(self) -> logging.Logger:
        return self.table.log

    # ------------------------------------------------------------ membership
    def follow(
        self, discovery: str, deployment: str, secret: bytes, grace_s: float = 10.0, wait_s: float = 0.0
    ) -> None:
        """Follow the deployment's decode records in etcd at ``discovery``; ``wait_s``: how long
        to wait for the first listing."""
        self._membership = Membership(
            EtcdClient(discovery),
            deployment,
            secret,
            role="decode",
            accept=None if self.fixed else routable,
            on_change=lambda joined, left: self.post(self._reported if self.fixed else self.update, joined, left),
            grace_s=grace_s,
        )
        if wait_s and not self._membership.wait_listed(wait_s):
            self.log.warning("etcd at %s does not answer yet: no decode instance known", discovery)

    def update(self, joined: list[InstanceRecord], left: list[InstanceRecord]) -> None:
        """Records that joined or changed, and records that left (their requests move)."""
        for name, why, lost in self.table.update(joined, left):
            if lost:
                self._on_lost(name, why, lost)
        self._wake.set()  # a member that joined is probed now, not a round later

    def _reported(self, joined: list[InstanceRecord], left: list[InstanceRecord]) -> None:
        """Fixed decode models: what the records of this server's instances serving them say (a
        record that left changes nothing: a reloaded instance's new record follows)."""
        fixed = set(self.fixed)
        for record in joined:
            if record.model in fixed and record.grpc_url == self.own_url:
                self.table.report(record.model, record)

    # ------------------------------------------------------------ links
    def link(self, name: str) -> DecodeLink | None:
        """How to reach target ``name`` (None once it left)."""
        target = self.table.target(name)
        if target is None:
            return None
        if not target.grpc_url and self.own_url:
            target = replace(target, grpc_url=self.own_url)  # a decode model of the front's server
        with self._lock:
            link = old = self._links.get(name)
            if link is None or link.target != target:
                link = self._links[name] = self._make_link(target)
        if old is not None and old is not link:
            old.close()  # its probe channel: the target moved
        return link

    # ------------------------------------------------------------ health
    def heard(self, name: str) -> None:
        """A stream of ``name`` delivered a response (it is alive)."""
        self.table.heard(name)

    def probed(self, name: str, error: str | None = None, unanswered: bool = False) -> None:
        """A readiness probe of ``name`` passed, or failed with ``error`` (``unanswered``: no
        answer came)."""
        lost = self.table.probed(name, error, unanswered=unanswered)
        if lost and error is not None:
            self._on_lost(name, error, lost)

    def failed(self, name: str, why: str) -> None:
        """A failed probe of ``name``, or a stream it ended that was not the request's fault."""
        lost = self.table.failed(name, why)
        if lost:
            self._on_lost(name, why, lost)

    def start_probing(self, first_delay_s: float = 0.0) -> None:
        """Probe every target every round, after ``first_delay_s`` (the Triton front's
        ``initialize`` must return first: a BLS call sent while the calling model still
        initializes took tritonserver down)."""
        self._thread = threading.Thread(
            target=self._probe_loop, args=(first_delay_s,), name="front-probes", daemon=True
        )
        self._thread.start()

    def _probe_loop(self, first_delay_s: float) -> None:
        if self._stop.wait(first_delay_s):
            return
        timeout = self.table.settings.health_probe_timeout_s
        while not self._stop.is_set():
            now = time.monotonic()
            for name in self.table.names():
                with self._lock:
                    since = self._probing.setdefault(name, now)
                if since == now:
                    threading.Thread(target=self._probe, args=(name,), daemon=True).start()
                elif now - since > timeout:  # still unanswered: a failure per round until it returns
                    self.post(self.probed, name, f"readiness probe unanswered for {now - since:.0f}s", True)
            self._wake.wait(self.table.probe_interval())
            self._wake.clear()

    def _probe(self, name: str) -> None:
        try:
            link = self.link(name)
            reply = link.probe() if link is not None else None
        except Exception as e:
            reply = Reply(error=f"{type(e).__name__}: {e}")
        with self._lock:
            self._probing.pop(name, None)
        if reply is not None and not self._stop.is_set():  # (None: it left meanwhile)
            self.post(self.probed, name, reply.error, reply.error is not None and reply.unanswered)

    def close(self) -> None:
        """Stop probing and following the membership, and close every link's probe channel."""
        self._stop.set()
        self._wake.set()
        if self._membership is not None:
            self._membership.close()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=2.0)
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
