"""The KV messenger protocol between decode and prefill instances: typed messages, a version
checked at the handshake, validation of every field before a message reaches a worker.

Frames and the handshake exchange are ``fabric_bridge.control``'s (4-byte length + UTF-8 JSON;
a refusal is ``{"error": reason}``); a message is a JSON object with ``"type"`` and its fields.
The KV bytes never travel here: they go over NIXL.

  decode -> prefill   AuthChallenge(version, name, nonce)        (see backend/disagg/auth.py)
  prefill -> decode   AuthResponse(nonce, proof)
  decode -> prefill   Hello(version, name, fabric, proof)    fabric: the agent's handshake payload
  prefill -> decode   Hello(version, name, fabric, "")  or  {"error": reason} (refused)
  decode -> prefill   PrefillRequest(req_id, generation, slot, tokens, dst_pages, first_page, cache_salt,
                                     traceparent)
  prefill -> decode   PrefillStarted(req_id, generation)   its first chunk is scheduled
  decode -> prefill   Cancel(req_id)
  prefill -> decode   PrefillFailed(req_id, kind, message)   the prefill will not complete
  prefill -> decode   CacheReport(summary)   its prefix cache and load, every cache_report_interval_s

Version history: 1 = the first typed, versioned protocol; 2 = peers authenticate (HMAC
challenge-response) before the hello; 3 = the prefill instance reports when it starts a request
(PrefillStarted), so the decode side's transfer deadline does not count its queueing there;
4 = a prefill request names the first page it asks for (``first_page``): the decode instance
holds the pages before it already (its prefix cache), ``dst_pages`` are for the pages from there
on, and the prefill instance sends only those; 5 = the prefill instance reports its prefix cache
and load (CacheReport, ``backend/engine/cache_summary.py``), so decode instances route by it;
6 = a prefill request carries the request's ``cache_salt`` (its prefix-cache tenant: the prefill
instance's cache and tiers match its pages only with requests of the same salt), and a cache
report's summary lists the blocks of the prefill instance's host and disk tiers (``tier_keys``);
7 = a prefill request carries the W3C ``traceparent`` of the decode instance's KV transfer span
("" : not traced), so the prefill instance's spans join the request's trace.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from backend.engine.cache_summary import CacheSummary
from backend.engine.outputs import ErrorKind
from backend.engine.sampling_params import MAX_CACHE_SALT

PROTOCOL_VERSION = 7
MAX_TRACEPARENT = 256
MAX_FRAME_BYTES = 4 << 20  # a prefill request of 100k tokens is about 1 MiB of JSON
MAX_PROMPT_TOKENS = 1 << 20
MAX_REQ_ID_LEN = 256


class ProtocolError(ValueError):
    """A message that does not follow the protocol (unknown type, missing or bad field)."""


@dataclass(frozen=True)
class AuthChallenge:
    version: int
    name: str
    nonce: str


@dataclass(frozen=True)
class AuthResponse:
    nonce: str
    proof: str


@dataclass(frozen=True)
class Hello:
    version: int
    name: str
    fabric: dict
    proof: str


@dataclass(frozen=True)
class PrefillRequest:
    req_id: str
    generation: int
    slot: int | None
    tokens: list[int]
    dst_pages: list[int]
    first_page: int  # pages [0, first_page) of the prompt are not sent: the decode instance has them
    cache_salt: str = ""  # the request's prefix-cache tenant (SamplingParams.cache_salt)
    traceparent: str = ""  # the decode side's KV transfer span (W3C), "" when not traced


@dataclass(frozen=True)
class PrefillStarted:
    req_id: str
    generation: int


@dataclass(frozen=True)
class Cancel:
    req_id: str


@dataclass(frozen=True)
class PrefillFailed:
    req_id: str
    kind: ErrorKind
    message: str


@dataclass(frozen=True)
class CacheReport:
    summary: CacheSummary


Message = AuthChallenge | AuthResponse | Hello | PrefillRequest | PrefillStarted | Cancel | PrefillFailed | CacheReport
TYPES: dict[str, type] = {
    "auth_challenge": AuthChallenge,
    "auth_response": AuthResponse,
    "hello": Hello,
    "prefill": PrefillRequest,
    "prefill_started": PrefillStarted,
    "cancel": Cancel,
    "prefill_failed": PrefillFailed,
    "cache_report": CacheReport,
}
_NAMES = {cls: name for name, cls in TYPES.items()}


def encode(msg: Message) -> dict:
    if isinstance(msg, CacheReport):
        return {"type": _NAMES[CacheReport], "summary": msg.summary.to_json()}
    return {"type": _NAMES[type(msg)], **dataclasses.asdict(msg)}


def decode(obj) -> Message:
    """A validated message from a received JSON value; :class:`ProtocolError` says what is wrong
    (for a refusal ``{"error": reason}``, the peer's reason)."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message must be a JSON object, got {type(obj).__name__}")
    if set(obj) == {"error"}:
        raise ProtocolError(f"refused by the peer: {obj['error']}")
    name = obj.get("type")
    if not isinstance(name, str) or (cls := TYPES.get(name)) is None:
        raise ProtocolError(f"unknown message type {name!r}; known: {sorted(TYPES)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(obj) - fields - {"type"})
    if extra:
        raise ProtocolError(f"{name}: unknown field(s) {extra}")
    values = {}
    for field in fields:
        if field not in obj:
            raise ProtocolError(f"{name}: missing field {field!r}")
        values[field] = _check(name, field, obj[field], hints[field])
    msg = cls(**values)
    if (
        isinstance(msg, (PrefillRequest, PrefillStarted, Cancel, PrefillFailed))
        and not 0 < len(msg.req_id) <= MAX_REQ_ID_LEN
    ):
        raise ProtocolError(f"{name}: req_id must be 1..{MAX_REQ_ID_LEN} characters")
    if isinstance(msg, PrefillRequest) and len(msg.tokens) > MAX_PROMPT_TOKENS:
        raise ProtocolError(f"prefill: {len(msg.tokens)} tokens exceed {MAX_PROMPT_TOKENS}")
    if isinstance(msg, PrefillRequest) and len(msg.cache_salt) > MAX_CACHE_SALT:
        raise ProtocolError(f"prefill: cache_salt longer than {MAX_CACHE_SALT} characters")
    if isinstance(msg, PrefillRequest) and len(msg.traceparent) > MAX_TRACEPARENT:
        raise ProtocolError(f"prefill: traceparent longer than {MAX_TRACEPARENT} characters")
    return msg


def _check(msg_name: str, field: str, value, typ):
    where = f"{msg_name}.{field}"
    if typ is CacheSummary:
        try:
            return CacheSummary.from_json(value)
        except ValueError as e:
            raise ProtocolError(f"{where}: {e}") from None
    if typ is ErrorKind:
        try:
            return ErrorKind(value)
        except ValueError:
            raise ProtocolError(f"{where}: unknown error kind {value!r}") from None
    optional = type(None) in typing.get_args(typ)
    if optional:
        if value is None:
            return None
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ProtocolError(f"{where} must be a non-negative integer, got {value!r}")
        return value
    if typ is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where} must be a string")
        return value
    if typ is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where} must be an object")
        return value
    if typing.get_origin(typ) is list:
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
        ):
            raise ProtocolError(f"{where} must be a list of non-negative integers")
        return value
    raise AssertionError(f"unhandled field type {typ} of {where}")


def require(msg: Message, cls: type):
    """``msg`` if it is a ``cls`` (an :class:`AuthChallenge` or :class:`Hello` also of this
    protocol version), else :class:`ProtocolError`."""
    if not isinstance(msg, cls):
        raise ProtocolError(f"expected {_NAMES[cls]}, got {_NAMES[type(msg)]}")
    if isinstance(msg, (AuthChallenge, Hello)) and msg.version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"messenger protocol version {msg.version} is not supported (this instance "
            f"speaks version {PROTOCOL_VERSION})"
        )
    return msg
