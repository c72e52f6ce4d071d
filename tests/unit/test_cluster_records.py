"""Instance records for the etcd membership (backend/cluster/records.py): the signed wire form
round-trips, and every kind of bad record is refused with a reason that names the problem."""

from __future__ import annotations

import dataclasses
import json

import pytest

from backend.cluster.records import BadRecord, InstanceRecord, decode, encode, key_of, prefix_of

SECRET = "0123456789abcdef0123456789abcdef"


def record(**changes) -> InstanceRecord:
    base = InstanceRecord(
        deployment="dep1",
        name="host-a:prefill_0:4242",
        role="prefill",
        grpc_url="10.0.0.1:8001",
        model="prefill_0",
        messenger="10.0.0.1:7000",
        model_identity="sha256:abc",
        kv_layout="hnd-p16-l30-h3-d64-bf16",
        tp_size=1,
        started_at=1700000000.5,
    )
    return dataclasses.replace(base, **changes)


def tamper(raw: bytes, mutate) -> bytes:
    envelope = json.loads(raw)
    mutate(envelope)
    return json.dumps(envelope).encode()


def refused(raw: bytes, secret: str | bytes = SECRET, **kw) -> str:
    with pytest.raises(BadRecord) as info:
        decode(raw, secret, **kw)
    assert info.value.reason == str(info.value)
    return info.value.reason


def test_round_trip_and_keys():
    for r in (record(), record(role="decode", messenger="", draining=True, tp_size=2), record(role="router")):
        raw = encode(r, SECRET)
        assert decode(raw, SECRET) == r
        assert decode(raw, SECRET.encode(), key=key_of(r)) == r  # bytes or str secret
    assert key_of(record()) == "/triton-disagg/dep1/instances/prefill/host-a:prefill_0:4242"
    assert prefix_of("dep1") == "/triton-disagg/dep1/instances/"
    assert prefix_of("dep1", "decode") == "/triton-disagg/dep1/instances/decode/"
    assert key_of(record()).startswith(prefix_of("dep1", "prefill"))
    with pytest.raises(ValueError):
        prefix_of("dep1", "worker")


def test_wrong_secret():
    assert "signature" in refused(encode(record(), SECRET), secret="another-secret-of-32-bytes-length")


def test_tampered_field():
    raw = tamper(encode(record(), SECRET), lambda e: e["record"].update(grpc_url="6.6.6.6:8001"))
    assert "signature" in refused(raw)
    raw = tamper(encode(record(), SECRET), lambda e: e["record"].update(draining=True))
    assert "signature" in refused(raw)


def test_malformed_json():
    assert "malformed JSON" in refused(b'{"v": 1, "record": {')
    assert "malformed JSON" in refused(b"\xff\xfe")
    assert "malformed" in refused(b"[1, 2]")
    assert "malformed envelope" in refused(b'{"record": {}}')


def test_missing_extra_and_mistyped_fields():
    raw = tamper(encode(record(), SECRET), lambda e: e["record"].pop("kv_layout"))
    assert "missing field(s) kv_layout" in refused(raw)
    raw = tamper(encode(record(), SECRET), lambda e: e["record"].update(colour="red"))
    assert "unknown field(s) colour" in refused(raw)
    raw = tamper(encode(record(), SECRET), lambda e: e["record"].update(tp_size="2"))
    assert "tp_size" in refused(raw)
    raw = tamper(encode(record(), SECRET), lambda e: e["record"].update(tp_size=True))
    assert "tp_size" in refused(raw)
    raw = tamper(encode(record(), SECRET), lambda e: e["record"].update(draining="no"))
    assert "draining" in refused(raw)


def test_unknown_role():
    raw = tamper(encode(record(), SECRET), lambda e: e["record"].update(role="worker"))
    assert "role 'worker'" in refused(raw)
    with pytest.raises(BadRecord, match="role 'worker'"):
        encode(record(role="worker"), SECRET)


def test_record_under_another_key():
    raw = encode(record(), SECRET)
    reason = refused(raw, key="/triton-disagg/dep1/instances/decode/host-a:prefill_0:4242")
    assert "stored under" in reason


def test_short_secret_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        encode(record(), "short")
