"""The drain request (``backend/serving/drain.py``): only a fresh request naming this instance and
signed with the deployment secret drains it. End to end: ``tests/integration/test_membership_deployment.py``."""

from __future__ import annotations

import json

import pytest

from backend.serving.drain import MAX_AGE_S, check_drain_request, drain_request

SECRET = b"unit-test-secret-0123456789"
NOW = 1_800_000_000.0  # the requests are made and checked at this time (collection may be long before the test)


def test_a_signed_fresh_request_for_this_instance_passes():
    check_drain_request(drain_request(SECRET, "host-decode_1-42"), SECRET, "host-decode_1-42")


@pytest.mark.parametrize(
    "raw,message",
    [
        (drain_request(SECRET, "host-decode_0-41", now=NOW), "not 'host-decode_0-41'"),
        (
            drain_request(b"another-secret-0123456789", "host-decode_1-42", now=NOW),
            "does not prove the deployment secret",
        ),
        (drain_request(SECRET, "host-decode_1-42", now=0.0), "old"),
        ("not json", "JSON object"),
        (json.dumps({"instance": "host-decode_1-42", "t": 5}), "JSON object"),
    ],
)
def test_other_requests_are_refused_with_the_reason(raw, message):
    with pytest.raises(ValueError, match=message):
        check_drain_request(raw, SECRET, "host-decode_1-42", now=NOW)


def test_a_replayed_request_expires():
    raw = drain_request(SECRET, "i", now=1000.0)
    check_drain_request(raw, SECRET, "i", now=1000.0 + MAX_AGE_S - 1)
    with pytest.raises(ValueError, match="old"):
        check_drain_request(raw, SECRET, "i", now=1000.0 + MAX_AGE_S + 1)
