"""Draining one instance: its request to drain (signed with the deployment secret, so only an
operator who holds it can take an instance out), its checks, and where it travels: apart from
the models' inputs, under the instance's control key in the deployment's etcd
(:func:`drain_key`), which the instance watches (:class:`DrainRequests`).

``triton-disagg drain INSTANCE`` (``backend/launch/drain.py``) finds the instance's record in the
deployment's membership and writes a JSON object ``{"instance": NAME, "t": UNIX_TIME, "proof":
HMAC}`` at its key. The instance checks that it names this instance, is at most
:data:`MAX_AGE_S` old and proves the secret (any other is logged and ignored), deletes the key,
then drains: a decode instance marks its record ``draining`` (routers send it nothing new),
refuses new requests with kind ``draining`` (routers send them elsewhere), lets the requests in
flight finish for up to ``drain_timeout_s``, ends the rest as out of service (routers move them,
with the output already sent, to another decode instance) and leaves the membership; a prefill
instance marks its record ``draining`` (decode instances stop sending to it), finishes what it
has, and leaves.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from backend.cluster.etcd import EtcdClient, EtcdError
from backend.disagg import auth
from backend.serving.config import InstanceConfig

log = logging.getLogger("triton_disagg.drain")
CONTROL_ROOT = "/triton-disagg-control"  # apart from the records under /triton-disagg/
RETRY_S = 1.0

MAX_AGE_S = 120.0
_ROLE = "drain"


def drain_request(secret: bytes, instance: str, now: float | None = None) -> str:
    t = f"{time.time() if now is None else now:.3f}"
    return json.dumps({"instance": instance, "t": t, "proof": auth.proof(secret, _ROLE, instance, t)})


def check_drain_request(raw: str, secret: bytes, instance: str, now: float | None = None) -> None:
    """Raise ValueError (the reason) unless ``raw`` is a fresh drain request for ``instance``."""
    try:
        obj = json.loads(raw)
        name, t, proof = obj["instance"], obj["t"], obj["proof"]
        if not all(isinstance(v, str) for v in (name, t, proof)):
            raise TypeError
        age = (time.time() if now is None else now) - float(t)
    except (ValueError, KeyError, TypeError):
        raise ValueError("a drain request is a JSON object with string fields instance, t and proof") from None
    if name != instance:
        raise ValueError(f"this is instance {instance!r}, not {name!r}")
    if not -MAX_AGE_S < age < MAX_AGE_S:
        raise ValueError(f"the drain request is {age:.0f} s old (at most {MAX_AGE_S:.0f} s)")
    try:
        auth.verify(secret, _ROLE, name, t, proof)
    except auth.AuthError:
        raise ValueError("the drain request does not prove the deployment secret") from None


def drain_key(deployment: str, instance: str) -> str:
    """Where a drain request for ``instance`` of ``deployment`` is written."""
    return f"{CONTROL_ROOT}/{deployment}/drain/{instance}"


class DrainRequests:
    """Watches ``instance``'s drain key in etcd from a daemon thread; a valid request runs
    ``on_drain()`` once (later ones are acknowledged and ignored). Every request seen is
    deleted, so the key says whether the instance has read it. An etcd outage is retried
    quietly (one log line)."""

    def __init__(
        self, client: EtcdClient, deployment: str, instance: str, secret: bytes, on_drain: Callable[[], object]
    ):
        self.client, self.instance, self._secret, self._on_drain = client, instance, secret, on_drain
        self.key = drain_key(deployment, instance)
        self.drained = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"drain-requests-{instance}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        outage = False
        while not self._stop.is_set():
            try:
                revision, kvs = self.client.get_prefix(self.key)
                outage = False
                for raw in kvs.values():
                    self._handle(raw)
                for event in self.client.watch_prefix(self.key, revision + 1, self._stop):
                    if event.kind == "put":
                        self._handle(event.value)
            except EtcdError as e:
                if not outage:
                    log.warning("instance %s: watching its drain key in etcd: %s; retrying", self.instance, e)
                outage = True
            self._stop.wait(RETRY_S)

    def _handle(self, raw: bytes) -> None:
        try:
            self.client.delete(self.key)
        except EtcdError as e:
            log.warning("instance %s: could not delete the drain request it read: %s", self.instance, e)
        try:
            check_drain_request(raw.decode(), self._secret, self.instance)
        except (ValueError, UnicodeDecodeError) as e:
            log.warning("instance %s: drain request refused: %s", self.instance, e)
            return
        if self.drained:
            log.info("instance %s: drain request: draining already", self.instance)
            return
        self.drained = True
        log.warning("instance %s: drain requested (triton-disagg drain)", self.instance)
        self._on_drain()

    def close(self) -> None:
        self._stop.set()


def watch_drain_requests(
    config: InstanceConfig, instance: str | None, secret: bytes | None, on_drain: Callable[[], object]
) -> DrainRequests | None:
    """Watch this instance's drain key (None: it has no membership record to drain)."""
    c = config.membership
    if not c.discovery or instance is None or secret is None:
        return None
    return DrainRequests(EtcdClient(c.discovery), c.deployment, instance, secret, on_drain)
