"""Notification: the typed message two agents exchange over NIXL, and its wire form.

A notification rides in every KV/meta xfer (NIXL delivers it to the target after the xfer's
data) or travels alone (``send_notif``). On the wire it stays compact, one short ASCII line::

    b"<kind>:<generation>:<count>:<req_id>"      e.g. b"W:7:96:req-42"

``count`` is the number of KV writes (``WRITES_LANDED``) or meta floats (``META_LANDED``) the
xfer carried, 0 for the two control kinds. ``req_id`` is last, so it may contain ``:``.
:meth:`Notification.decode` refuses anything else with :class:`MalformedNotification` (a
``ValueError``); no other module parses or formats these bytes. :func:`pack` is
``Notification(...).encode()`` without building the object, for the sender's hot path (one
call per posted xfer).

Lock discipline: none. Pure values, no state; safe from any thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(enum.Enum):
    """What a notification says; the value is its one-letter wire tag."""

    WRITES_LANDED = "W"  # sender -> receiver: ``count`` KV writes of an xfer landed
    META_LANDED = "M"  # sender -> receiver: the meta block (``count`` floats) landed in its slot
    CANCELLED_BY_RECEIVER = "X"  # receiver -> sender: cancelled or timed out, stop sending
    SENDER_STOPPED = "S"  # sender -> receiver: nothing in flight, nothing more will be posted


_BY_TAG = {k.value: k for k in Kind}


class MalformedNotification(ValueError):
    """Bytes that are not a notification (the progress loop logs and drops them)."""


def _number(field: str, what: str, data: bytes) -> int:
    if not (field.isascii() and field.isdigit()):
        raise MalformedNotification(f"{what} is not a non-negative integer in notification {data!r}")
    return int(field)


def pack(kind: Kind, generation: int, count: int, req_id: str) -> bytes:
    """The wire form of ``Notification(kind, generation, count, req_id)``."""
    return f"{kind.value}:{generation}:{count}:{req_id}".encode()


@dataclass(frozen=True, slots=True)
class Notification:
    """One message between agents (see module docstring)."""

    kind: Kind
    generation: int
    count: int
    req_id: str

    def encode(self) -> bytes:
        return pack(self.kind, self.generation, self.count, self.req_id)

    @classmethod
    def decode(cls, data: bytes) -> Notification:
        """Parse the wire form; :class:`MalformedNotification` for anything else."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise MalformedNotification(f"notification {data!r} is not bytes")
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise MalformedNotification(f"notification {data!r} is not UTF-8 bytes") from e
        parts = text.split(":", 3)
        if len(parts) != 4:
            raise MalformedNotification(f"notification {data!r} has {len(parts)} fields, expected 4")
        tag, gen, count, req_id = parts
        kind = _BY_TAG.get(tag)
        if kind is None:
            raise MalformedNotification(f"unknown notification kind {tag!r} in {data!r}")
        if not req_id:
            raise MalformedNotification(f"notification {data!r} names no request")
        return cls(kind, _number(gen, "generation", data), _number(count, "count", data), req_id)
