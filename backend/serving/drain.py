"""Draining one instance: its request to drain (signed with the deployment secret, so only an
operator who holds it can take an instance out) and its checks.

``triton-disagg drain INSTANCE`` (``backend/launch/drain.py``) finds the instance's record in the
deployment's membership and sends its Triton model a control request with input
``drain_request``: a JSON object ``{"instance": NAME, "t": UNIX_TIME, "proof": HMAC}``. The model
checks that it names this instance, is at most :data:`MAX_AGE_S` old and proves the secret, then
drains: a decode instance marks its record ``draining`` (routers send it nothing new), refuses new
requests with kind ``draining`` (routers send them elsewhere), lets the requests in flight finish
for up to ``drain_timeout_s``, ends the rest as out of service (routers move them, with the output
already sent, to another decode instance) and leaves the membership; a prefill instance marks its
record ``draining`` (decode instances stop sending to it), finishes what it has, and leaves.
"""

from __future__ import annotations

import json
import time

from backend.disagg import auth

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
