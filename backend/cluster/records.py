"""An instance's membership record: what a prefill, decode or router instance, or a host's agent
(``triton-disagg agent``, which starts and stops instances for the autoscaler), publishes in etcd
about itself, signed with the deployment secret (HMAC-SHA256) so that whoever can write to etcd
but does not hold the secret cannot add an instance, and where it lives in etcd.

Wire form (UTF-8 JSON)::

    {"v": 1, "record": {<every field>}, "sig": HMAC-SHA256(secret, DOMAIN | canonical(record)) hex}

where canonical is the record's JSON with sorted keys and no spaces. Keys:
``/triton-disagg/<deployment>/instances/<role>/<name>``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any

ROLES = ("prefill", "decode", "router", "agent")
KEY_ROOT = "/triton-disagg"
WIRE_VERSION = 1
MIN_SECRET_BYTES = 16
_DOMAIN = b"triton-disagg instance record v1|"


class BadRecord(ValueError):
    """A record that is not a valid, correctly signed instance record; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class InstanceRecord:
    deployment: str
    name: str  # unique instance name, e.g. "host:decode_0:pid"
    role: str  # "prefill" | "decode" | "router" | "agent"
    grpc_url: str  # Triton's gRPC host:port ("" when it has none)
    model: str  # the Triton model serving it, e.g. "decode_0"
    messenger: str  # the KV messenger's host:port (prefill role), "" otherwise
    model_identity: str  # hash of the model and its weights format
    kv_layout: str  # identity of the KV layout
    tp_size: int
    started_at: float
    draining: bool = False
    metrics_url: str = ""  # the Prometheus endpoint of its server (http://host:port/metrics), "" if none
    control_url: str = ""  # an agent's control API (http://host:port), "" for every other role
    # what a decode instance tells routers about itself (rewritten when it changes): why it cannot
    # serve now ("": it can), and its cache summary (JSON, ``backend/engine/cache_summary.py``; "":
    # none), which the KV-aware routers read
    health: str = ""
    cache: str = ""


_FIELDS: dict[str, tuple[type, ...]] = {
    "deployment": (str,),
    "name": (str,),
    "role": (str,),
    "grpc_url": (str,),
    "model": (str,),
    "messenger": (str,),
    "model_identity": (str,),
    "kv_layout": (str,),
    "tp_size": (int,),
    "started_at": (float, int),
    "draining": (bool,),
    "metrics_url": (str,),
    "control_url": (str,),
    "health": (str,),
    "cache": (str,),
}
assert set(_FIELDS) == {f.name for f in dataclasses.fields(InstanceRecord)}


def secret_bytes(secret: bytes | str) -> bytes:
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"the deployment secret must have at least {MIN_SECRET_BYTES} bytes")
    return raw


def _canonical(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _signature(secret: bytes, fields: dict[str, Any]) -> str:
    return hmac.new(secret, _DOMAIN + _canonical(fields), hashlib.sha256).hexdigest()


def _check_fields(fields: dict[str, Any]) -> None:
    missing = sorted(set(_FIELDS) - set(fields))
    if missing:
        raise BadRecord(f"missing field(s) {', '.join(missing)}")
    extra = sorted(set(fields) - set(_FIELDS))
    if extra:
        raise BadRecord(f"unknown field(s) {', '.join(extra)}")
    for name, types in _FIELDS.items():
        value = fields[name]
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise BadRecord(
                f"field {name} is {type(value).__name__}, expected {' or '.join(t.__name__ for t in types)}"
            )
    if fields["role"] not in ROLES:
        raise BadRecord(f"role {fields['role']!r} is not one of {', '.join(ROLES)}")
    for name in ("deployment", "name"):
        if not fields[name] or "/" in fields[name]:
            raise BadRecord(f"field {name} {fields[name]!r} must be non-empty and without '/'")
    if fields["tp_size"] < 1:
        raise BadRecord(f"field tp_size is {fields['tp_size']}, expected at least 1")


def encode(record: InstanceRecord, secret: bytes | str) -> bytes:
    """The signed wire form of ``record``; raises ``BadRecord`` for a record ``decode`` would refuse."""
    fields = dataclasses.asdict(record)
    _check_fields(fields)
    fields["started_at"] = float(fields["started_at"])
    envelope = {"v": WIRE_VERSION, "record": fields, "sig": _signature(secret_bytes(secret), fields)}
    return json.dumps(envelope, sort_keys=True, separators=(",", ":")).encode()


def decode(raw: bytes, secret: bytes | str, key: str | None = None) -> InstanceRecord:
    """The record in ``raw`` once its signature is checked; with ``key``, it must also be the
    record's own key. Raises ``BadRecord`` naming the problem."""
    try:
        envelope = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRecord(f"malformed JSON ({e})") from None
    if not isinstance(envelope, dict):
        raise BadRecord(f"malformed record: a JSON {type(envelope).__name__}, expected an object")
    if set(envelope) != {"v", "record", "sig"}:
        raise BadRecord(f"malformed envelope: keys {sorted(envelope)}, expected ['record', 'sig', 'v']")
    if envelope["v"] != WIRE_VERSION:
        raise BadRecord(f"wire version {envelope['v']!r}, expected {WIRE_VERSION}")
    fields, sig = envelope["record"], envelope["sig"]
    if not isinstance(fields, dict) or not isinstance(sig, str):
        raise BadRecord("malformed envelope: record must be an object and sig a string")
    _check_fields(fields)
    if not hmac.compare_digest(_signature(secret_bytes(secret), fields), sig):
        raise BadRecord("wrong signature (not signed with this deployment's secret, or altered)")
    record = InstanceRecord(**{**fields, "started_at": float(fields["started_at"])})
    if key is not None and key != key_of(record):
        raise BadRecord(f"stored under {key!r}, but the record's key is {key_of(record)!r}")
    return record


def prefix_of(deployment: str, role: str | None = None) -> str:
    """The etcd prefix of a deployment's instances (of one role, when given)."""
    if not deployment or "/" in deployment:
        raise ValueError(f"deployment {deployment!r} must be non-empty and without '/'")
    if role is None:
        return f"{KEY_ROOT}/{deployment}/instances/"
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    return f"{KEY_ROOT}/{deployment}/instances/{role}/"


def key_of(record: InstanceRecord) -> str:
    return prefix_of(record.deployment, record.role) + record.name


def routable(record: InstanceRecord) -> str | None:
    """None for a decode record a router can reach (a gRPC ``host:port`` and a model), else why not."""
    host, sep, port = record.grpc_url.rpartition(":")
    if not sep or not host or not port.isdigit():
        return f"grpc_url {record.grpc_url!r} is not host:port"
    if not record.model:
        return "it names no Triton model"
    return None
