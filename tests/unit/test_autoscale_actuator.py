"""The autoscaler's actuator over host agents (backend/autoscale/actuator.py): the signed control
requests (fresh, not replayed, bound to method, path and body) and LocalAgents' choice of agent
(fewest live instances, another one when one refuses, a failing one put last for a while). No
HTTP: the AgentClient calls are replaced."""

from __future__ import annotations

import time

import pytest

from backend.autoscale import actuator
from backend.autoscale.actuator import ActuatorError, AgentClient, LocalAgents, Managed, RequestVerifier, sign
from backend.cluster.records import InstanceRecord
from backend.disagg.auth import AuthError

SECRET = b"0123456789abcdef0123456789abcdef"
BODY = b'{"role": "decode"}'


# signed requests


def test_a_fresh_signed_request_is_accepted():
    v = RequestVerifier(SECRET)
    v.check(sign(SECRET, "POST", "/instances", BODY), "POST", "/instances", BODY)
    v.check(sign(SECRET, "GET", "/instances", b""), "GET", "/instances", b"")


@pytest.mark.parametrize(
    "header_of,method,path,body,reason",
    [
        (
            lambda: sign(b"another secret of 32 bytes......", "POST", "/instances", BODY),
            "POST",
            "/instances",
            BODY,
            "did not prove",
        ),
        (
            lambda: sign(SECRET, "POST", "/instances", BODY),
            "POST",
            "/instances",
            b'{"role": "prefill"}',
            "did not prove",
        ),
        (lambda: sign(SECRET, "POST", "/instances", BODY), "POST", "/instances/decode-1/stop", BODY, "did not prove"),
        (lambda: sign(SECRET, "GET", "/instances", BODY), "POST", "/instances", BODY, "did not prove"),
        (lambda: sign(SECRET, "POST", "/instances", BODY, now=time.time() - 61), "POST", "/instances", BODY, "old"),
        (lambda: sign(SECRET, "POST", "/instances", BODY, now=time.time() + 61), "POST", "/instances", BODY, "old"),
        (lambda: None, "POST", "/instances", BODY, "missing or malformed X-Triton-Disagg-Auth"),
        (lambda: "garbage", "POST", "/instances", BODY, "missing or malformed"),
        (lambda: "1:2:3:4", "POST", "/instances", BODY, "missing or malformed"),
        (lambda: "notatime:abc:def", "POST", "/instances", BODY, "missing or malformed"),
    ],
    ids=[
        "wrong-secret",
        "altered-body",
        "altered-path",
        "altered-method",
        "stale",
        "future",
        "missing",
        "malformed",
        "too-many-parts",
        "bad-time",
    ],
)
def test_an_inauthentic_request_is_refused_with_a_reason(header_of, method, path, body, reason):
    with pytest.raises(AuthError, match=reason):
        RequestVerifier(SECRET).check(header_of(), method, path, body)


def test_a_replayed_request_is_refused():
    v = RequestVerifier(SECRET)
    header = sign(SECRET, "POST", "/instances", BODY)
    v.check(header, "POST", "/instances", BODY)
    with pytest.raises(AuthError, match="replayed"):
        v.check(header, "POST", "/instances", BODY)
    # a fresh one still goes through
    v.check(sign(SECRET, "POST", "/instances", BODY), "POST", "/instances", BODY)


def test_an_inauthentic_request_does_not_burn_its_nonce():
    v = RequestVerifier(SECRET)
    header = sign(SECRET, "POST", "/instances", BODY)
    with pytest.raises(AuthError):
        v.check(header, "POST", "/instances", b"tampered")
    v.check(header, "POST", "/instances", BODY)


def test_a_request_within_the_age_limit_is_accepted():
    t = time.time()
    RequestVerifier(SECRET).check(sign(SECRET, "GET", "/x", b"", now=t - 50), "GET", "/x", b"", now=t)


# LocalAgents with fake agents


def agent(name: str, draining: bool = False, control_url: str = "http://h:1") -> InstanceRecord:
    return InstanceRecord("dep", name, "agent", "", "", "", "", "", 1, 1.0, draining, "", control_url)


def managed(where: str, n: int, role: str = "decode", alive: bool = True, stopping: bool = False) -> Managed:
    return Managed(f"{role}-{n}", role, where, f"h:{9000 + n}", alive, stopping, 1.0)


class FakeAgents:
    """What each fake agent holds, refuses, and the calls made to it (keyed by record name)."""

    def __init__(self, monkeypatch, holds: dict[str, list[Managed]]):
        self.holds = holds
        self.refuse: set[str] = set()
        self.unreachable: set[str] = set()
        self.starts: list[str] = []
        self.stops: list[tuple[str, str]] = []
        fake = self

        def instances(client: AgentClient) -> list[Managed]:
            if client.record.name in fake.unreachable:
                raise ActuatorError(f"agent {client.record.name}: connection refused")
            return list(fake.holds[client.record.name])

        def start(client: AgentClient, role: str) -> Managed:
            name = client.record.name
            fake.starts.append(name)
            if name in fake.refuse:
                raise ActuatorError(f"agent {name}: HTTP 409: it runs 4 instances, its maximum")
            m = managed(name, 100 + len(fake.starts), role)
            fake.holds[name].append(m)
            return m

        def stop(client: AgentClient, iid: str) -> Managed:
            fake.stops.append((client.record.name, iid))
            return managed(client.record.name, 0)

        monkeypatch.setattr(actuator.AgentClient, "instances", instances)
        monkeypatch.setattr(actuator.AgentClient, "start", start)
        monkeypatch.setattr(actuator.AgentClient, "stop", stop)


def test_start_goes_to_the_agent_with_the_fewest_live_instances(monkeypatch):
    fake = FakeAgents(
        monkeypatch,
        {
            "a": [managed("a", 1), managed("a", 2)],
            # b holds 3, but one exited and one is stopping: 1 live
            "b": [managed("b", 3), managed("b", 4, alive=False), managed("b", 5, stopping=True)],
            "c": [managed("c", 6), managed("c", 7), managed("c", 8)],
        },
    )
    la = LocalAgents(lambda: [agent("a"), agent("b"), agent("c")], SECRET)
    m = la.start("prefill")
    assert fake.starts == ["b"]
    assert (m.where, m.role) == ("b", "prefill")
    # now a and b hold 2 live each; the first of them in the membership's order
    la.start("decode")
    assert fake.starts == ["b", "a"]


def test_a_refusing_agent_is_passed_over_and_then_put_last(monkeypatch):
    fake = FakeAgents(monkeypatch, {"a": [], "b": [managed("b", 1)], "c": [managed("c", 2), managed("c", 3)]})
    fake.refuse.add("a")
    la = LocalAgents(lambda: [agent("a"), agent("b"), agent("c")], SECRET, failure_backoff_s=120.0)
    m = la.start("decode")
    assert fake.starts == ["a", "b"] and m.where == "b"
    # a holds the fewest, but it failed within the backoff: b and c come first
    fake.refuse.clear()
    fake.starts.clear()
    la.start("decode")  # b (2 live) before c (2 live, later in the list)
    la.start("decode")  # c (2) before b (3)
    assert fake.starts == ["b", "c"]
    # after the backoff a is first again
    la.failure_backoff_s = 0.0
    fake.starts.clear()
    assert la.start("decode").where == "a"


def test_start_failed_puts_an_agent_last(monkeypatch):
    fake = FakeAgents(monkeypatch, {"a": [], "b": [managed("b", 1)]})
    la = LocalAgents(lambda: [agent("a"), agent("b")], SECRET)
    la.start_failed("a")
    la.start("prefill")
    assert fake.starts == ["b"]


def test_an_unreachable_agent_is_tried_last(monkeypatch):
    fake = FakeAgents(monkeypatch, {"a": [], "b": [managed("b", 1), managed("b", 2)]})
    fake.unreachable.add("a")
    la = LocalAgents(lambda: [agent("a"), agent("b")], SECRET)
    assert la.start("decode").where == "b"
    # a listing that misses an agent is an error: its starting instances would be unknown
    with pytest.raises(ActuatorError, match="agent a: connection refused"):
        la.managed()
    fake.unreachable.clear()
    assert [m.where for m in la.managed()] == ["b", "b", "b"]


def test_when_every_agent_fails_the_error_names_each(monkeypatch):
    fake = FakeAgents(monkeypatch, {"a": [], "b": []})
    fake.refuse.update({"a", "b"})
    la = LocalAgents(lambda: [agent("a"), agent("b")], SECRET)
    with pytest.raises(ActuatorError, match="no agent could start a decode instance") as e:
        la.start("decode")
    assert "agent a: HTTP 409" in str(e.value) and "agent b: HTTP 409" in str(e.value)
    assert sorted(fake.starts) == ["a", "b"]


def test_no_agents_is_an_error(monkeypatch):
    FakeAgents(monkeypatch, {"a": []})
    with pytest.raises(ActuatorError, match="no agent in the membership"):
        LocalAgents(lambda: [], SECRET).start("decode")
    # draining agents and records without a control URL do not count
    la = LocalAgents(lambda: [agent("a", draining=True), agent("b", control_url="")], SECRET)
    with pytest.raises(ActuatorError, match="no agent in the membership"):
        la.start("prefill")


def test_stop_goes_to_the_agent_that_holds_the_instance(monkeypatch):
    fake = FakeAgents(monkeypatch, {"a": [], "b": []})
    la = LocalAgents(lambda: [agent("a"), agent("b")], SECRET)
    la.stop(managed("b", 7))
    assert fake.stops == [("b", "decode-7")]
    with pytest.raises(ActuatorError, match="agent gone of instance decode-7 is not in the membership"):
        la.stop(managed("gone", 7))
