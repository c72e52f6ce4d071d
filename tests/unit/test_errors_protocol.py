"""Error kinds across processes and the messenger protocol's validation (no server, no peer)."""

from __future__ import annotations

import pytest

from backend.disagg.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    Hello,
    PrefillFailed,
    PrefillRequest,
    ProtocolError,
    decode,
    encode,
    require,
)
from backend.engine.outputs import ErrorKind
from backend.serving.errors import format_error, parse_error


def test_error_kind_round_trip():
    for kind in ErrorKind:
        assert parse_error(format_error(kind, "it broke: [x] y")) == (kind, "it broke: [x] y")
    assert parse_error("out of service somewhere") == (None, "out of service somewhere")
    assert parse_error("[not_a_kind] x") == (None, "[not_a_kind] x")


def test_messages_round_trip():
    for msg in (
        Hello(PROTOCOL_VERSION, "d0", {"layout": {}}, "ab" * 32),
        PrefillRequest("r1", 2, None, [1, 2, 3], [7], 0),
        PrefillRequest("r2", 0, 5, [1], [0], 0, "tenant-a"),
        Cancel("r1"),
        PrefillFailed("r1", ErrorKind.OUT_OF_SERVICE, "rank 1 exited"),
    ):
        assert decode(encode(msg)) == msg


@pytest.mark.parametrize(
    "obj, message",
    [
        ([1, 2], "must be a JSON object"),
        ({"type": "prefil"}, "unknown message type 'prefil'"),
        ({"type": "cancel"}, "missing field 'req_id'"),
        ({"type": "cancel", "req_id": "r", "owner": "x"}, r"unknown field\(s\) \['owner'\]"),
        ({"type": "cancel", "req_id": ""}, "req_id must be"),
        (
            {
                "type": "prefill",
                "req_id": "r",
                "generation": "1",
                "slot": None,
                "tokens": [1],
                "dst_pages": [0],
                "first_page": 0,
                "cache_salt": "",
                "traceparent": "",
            },
            "generation must be a non-negative integer",
        ),
        (
            {
                "type": "prefill",
                "req_id": "r",
                "generation": 1,
                "slot": None,
                "tokens": [1, -2],
                "dst_pages": [0],
                "first_page": 0,
                "cache_salt": "",
                "traceparent": "",
            },
            "tokens must be a list of non-negative integers",
        ),
        (
            {
                "type": "prefill",
                "req_id": "r",
                "generation": 1,
                "slot": True,
                "tokens": [1],
                "dst_pages": [0],
                "first_page": 0,
                "cache_salt": "",
                "traceparent": "",
            },
            "slot must be a non-negative integer",
        ),
        (
            {
                "type": "prefill",
                "req_id": "r",
                "generation": 1,
                "slot": None,
                "tokens": [1],
                "dst_pages": [0],
                "first_page": 0,
                "cache_salt": "s" * 300,
                "traceparent": "",
            },
            "cache_salt longer than 256",
        ),
        (
            {
                "type": "prefill",
                "req_id": "r",
                "generation": 1,
                "slot": None,
                "tokens": [1],
                "dst_pages": [0],
                "first_page": 0,
                "cache_salt": "",
                "traceparent": "0" * 300,
            },
            "traceparent longer than 256",
        ),
        ({"type": "prefill_failed", "req_id": "r", "kind": "bad_luck", "message": "x"}, "unknown error kind"),
    ],
)
def test_bad_messages_are_refused(obj, message):
    with pytest.raises(ProtocolError, match=message):
        decode(obj)


def test_hello_version_is_checked():
    assert require(decode(encode(Hello(PROTOCOL_VERSION, "p", {}, ""))), Hello).name == "p"
    with pytest.raises(ProtocolError, match=f"version 99 is not supported .*version {PROTOCOL_VERSION}"):
        require(decode(encode(Hello(99, "p", {}, ""))), Hello)
    with pytest.raises(ProtocolError, match="expected hello"):
        require(Cancel("r"), Hello)
    with pytest.raises(ProtocolError, match="refused by the peer: no"):
        decode({"error": "no"})


def test_auth_proofs_and_secret_loading(tmp_path, monkeypatch):
    from backend.disagg import auth

    secret = b"s" * 32
    p = auth.proof(secret, "prefill", "a", "b")
    auth.verify(secret, "prefill", "a", "b", p)
    for role, first, second, key in (
        ("decode", "a", "b", secret),
        ("prefill", "b", "a", secret),
        ("prefill", "a", "b", b"t" * 32),
    ):
        with pytest.raises(auth.AuthError, match="did not prove"):
            auth.verify(key, role, first, second, p)  # other role, swapped nonces, other secret
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    with pytest.raises(auth.AuthError, match="is empty"):
        auth.load_secret()
    monkeypatch.setenv(auth.SECRET_ENV, "short")
    with pytest.raises(auth.AuthError, match="holds too few"):
        auth.load_secret()
    f = tmp_path / "secret"
    f.write_text(auth.new_secret() + "\n")
    assert auth.load_secret(str(f)) == f.read_text().strip().encode()
