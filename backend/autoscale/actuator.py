"""What the autoscaler acts through: an :class:`Actuator` starts an instance of a role and stops
(drains, then ends) one it manages. Two implementations: :class:`LocalAgents` here (the
``triton-disagg agent`` of each host, found in the membership) and ``KubernetesActuator``
(``backend/autoscale/kubernetes.py``: a Deployment's replicas per role).

An instance an actuator manages is matched with its membership record by its Triton gRPC
address: it is *starting* until a record with that address appears, *serving* while one is there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

import requests

from backend.cluster.records import InstanceRecord
from backend.disagg import auth

log = logging.getLogger("triton_disagg.autoscale")

AUTH_HEADER = "X-Triton-Disagg-Auth"
MAX_REQUEST_AGE_S = 60.0
_AUTH_ROLE = "agent-control"


class ActuatorError(RuntimeError):
    """An actuator could not carry out a start or a stop (the message says where and why)."""


@dataclass(frozen=True)
class Managed:
    """One instance an actuator started (or, on Kubernetes, one pod of a role's Deployment)."""

    id: str
    role: str
    where: str  # the agent (or Deployment) that holds it
    grpc_url: str  # what its membership record will carry ("" while unknown)
    alive: bool  # its process (pod) runs
    stopping: bool  # a stop was asked for
    started_at: float
    exit_code: int | None = None
    detail: str = ""  # e.g. the end of its log, when it exited

    def to_json(self) -> dict:
        return asdict(self)


class Actuator(Protocol):
    name: str

    def managed(self) -> list[Managed]: ...

    def start(self, role: str) -> Managed: ...

    def stop(self, instance: Managed) -> None: ...

    def start_failed(self, where: str) -> None:
        """An instance started at ``where`` exited or never joined: prefer elsewhere for a while."""
        ...


# the agents' control API: requests signed with the deployment secret


def sign(secret: bytes, method: str, path: str, body: bytes, now: float | None = None) -> str:
    """The auth header's value for one request: ``t:nonce:proof``, proof = HMAC over the method,
    path, the body's SHA-256, the time and a fresh nonce."""
    t = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(8)
    what = f"{method} {path} {hashlib.sha256(body).hexdigest()}"
    return f"{t}:{nonce}:{auth.proof(secret, _AUTH_ROLE, f'{t}:{nonce}', what)}"


class RequestVerifier:
    """Checks the auth header of a control request: fresh (within ``MAX_REQUEST_AGE_S``), a
    nonce not seen before (a recorded request cannot be replayed), and a proof of the secret."""

    def __init__(self, secret: bytes):
        self._secret = secret
        self._seen: dict[str, float] = {}

    def check(self, header: str | None, method: str, path: str, body: bytes, now: float | None = None) -> None:
        """Raise ``auth.AuthError`` with the reason unless the request is authentic."""
        now = time.time() if now is None else now
        try:
            t, nonce, proof = (header or "").split(":")
            age = now - float(t)
        except ValueError:
            raise auth.AuthError(f"missing or malformed {AUTH_HEADER} header") from None
        if not -MAX_REQUEST_AGE_S < age < MAX_REQUEST_AGE_S:
            raise auth.AuthError(f"the request is {age:.0f} s old (at most {MAX_REQUEST_AGE_S:.0f} s)")
        what = f"{method} {path} {hashlib.sha256(body).hexdigest()}"
        auth.verify(self._secret, _AUTH_ROLE, f"{t}:{nonce}", what, proof)
        self._seen = {n: s for n, s in self._seen.items() if now - s < 2 * MAX_REQUEST_AGE_S}
        if nonce in self._seen:
            raise auth.AuthError("the request was already received (replayed)")
        self._seen[nonce] = now


class AgentClient:
    """Signed calls to one agent's control API."""

    def __init__(self, record: InstanceRecord, secret: bytes, timeout_s: float = 10.0):
        self.record, self._secret, self.timeout_s = record, secret, timeout_s

    def _call(self, method: str, path: str, payload: dict | None = None) -> dict | list:
        body = json.dumps(payload).encode() if payload is not None else b""
        headers = {AUTH_HEADER: sign(self._secret, method, path, body), "content-type": "application/json"}
        url = self.record.control_url.rstrip("/") + path
        try:
            resp = requests.request(method, url, data=body, headers=headers, timeout=self.timeout_s)
        except requests.RequestException as e:
            raise ActuatorError(f"agent {self.record.name} at {self.record.control_url}: {e}") from None
        if resp.status_code != 200:
            raise ActuatorError(f"agent {self.record.name}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json()

    def instances(self) -> list[Managed]:
        out = self._call("GET", "/instances")
        assert isinstance(out, list)
        return [Managed(**item) for item in out]

    def start(self, role: str) -> Managed:
        out = self._call("POST", "/instances", {"role": role})
        assert isinstance(out, dict)
        return Managed(**out)

    def stop(self, instance_id: str) -> Managed:
        out = self._call("POST", f"/instances/{instance_id}/stop", {})
        assert isinstance(out, dict)
        return Managed(**out)


class LocalAgents:
    """The agents registered in the membership (``agents()`` gives their records). A start goes
    to the agent with the fewest live instances, skipping agents whose start failed within
    ``failure_backoff_s``; when one refuses or fails, the next one is tried."""

    name = "agents"

    def __init__(self, agents: Callable[[], list[InstanceRecord]], secret: bytes, failure_backoff_s: float = 120.0):
        self._agents, self._secret = agents, secret
        self.failure_backoff_s = failure_backoff_s
        self._failed_at: dict[str, float] = {}

    def _clients(self) -> list[AgentClient]:
        return [AgentClient(r, self._secret) for r in self._agents() if r.control_url and not r.draining]

    def managed(self) -> list[Managed]:
        """Every agent's instances; ``ActuatorError`` when one agent cannot be listed (its
        starting instances would be unknown, and a decision could start them twice)."""
        out = []
        for client in self._clients():
            out += client.instances()
        return out

    def start_failed(self, where: str) -> None:
        """An instance that ``where`` started failed later (exited, or never joined in time)."""
        self._failed_at[where] = time.monotonic()

    def start(self, role: str) -> Managed:
        clients = self._clients()
        if not clients:
            raise ActuatorError("no agent in the membership (start `triton-disagg agent` on a host)")
        now = time.monotonic()
        loads = {}
        for c in clients:
            try:
                loads[c.record.name] = sum(m.alive and not m.stopping for m in c.instances())
            except ActuatorError:
                loads[c.record.name] = 1 << 30
        order = sorted(
            clients,
            key=lambda c: (
                now - self._failed_at.get(c.record.name, -1e18) < self.failure_backoff_s,
                loads[c.record.name],
            ),
        )
        errors = []
        for c in order:
            try:
                m = c.start(role)
                log.info(
                    "autoscale: agent %s started a %s instance %s (gRPC %s)", c.record.name, role, m.id, m.grpc_url
                )
                return m
            except ActuatorError as e:
                self._failed_at[c.record.name] = now
                errors.append(str(e))
                log.warning("autoscale: %s; trying another agent", e)
        raise ActuatorError(f"no agent could start a {role} instance: " + "; ".join(errors))

    def stop(self, instance: Managed) -> None:
        for c in self._clients():
            if c.record.name == instance.where:
                c.stop(instance.id)
                return
        raise ActuatorError(f"agent {instance.where} of instance {instance.id} is not in the membership")
