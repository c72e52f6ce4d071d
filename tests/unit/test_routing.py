"""The routing and migration core both fronts share (``backend/serving/routing.py``), without any
transport: when a target is routable (first passing readiness probe, and its membership record
says neither draining nor why it cannot serve), what takes it down and which requests then move,
the KV-aware pick from the cache summaries in the records, and a request's moves (never back to
a target that failed it, the output sent goes along, at most ``migration_limit`` moves, the
prompt's log-probabilities relayed once, ``cum_log_probs`` summed across attempts)."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from backend.cluster.records import InstanceRecord
from backend.engine.cache_summary import CacheSummary, page_key
from backend.engine.page_allocator import page_hashes
from backend.serving.config import RouterSettings
from backend.serving.routing import FIRST_PROBE_INTERVAL_S, Journey, NotMoved, RoutingTable, Target

SALT = "00"
log = logging.getLogger("test_routing")


def summary(cached: list[int] | None = None, page_size: int = 4) -> CacheSummary:
    keys = frozenset(page_key(h) for h in page_hashes(cached or [], page_size, bytes.fromhex(SALT)))
    return CacheSummary(SALT, page_size, 1, keys, 1000, 1000, 0, 0)


def table(*names: str, up: bool = True, **kw) -> RoutingTable:
    t = RoutingTable(RouterSettings(**kw), log)
    for n in names:
        t.join(n)
        say(t, n, cached=[])  # its record: serving, nothing cached
        if up:
            t.probed(n)
    return t


def record(
    name: str,
    url: str = "a:8001",
    model: str = "decode_0",
    draining: bool = False,
    health: str = "",
    cached: list[int] | None = None,
    started: float = 0.0,
) -> InstanceRecord:
    cache = json.dumps(summary(cached).to_json()) if cached is not None else ""
    return InstanceRecord(
        "default", name, "decode", url, model, "", "m", "k", 1, started, draining=draining, health=health, cache=cache
    )


def say(t: RoutingTable, name: str, **fields) -> None:
    """What target ``name``'s membership record says (:func:`record`'s fields)."""
    t.report(name, record(name, **fields))


def journey(prompt: list[int] | None = None, pages: int = 2) -> Journey:
    return Journey("req", list(prompt or [1, 2, 3]), pages)


def test_a_target_serves_after_its_first_passing_probe_and_not_while_its_record_says_otherwise():
    t = table("a", "b", up=False)
    assert t.serving() == [] and t.pick(journey()) is None
    assert t.awaiting_first_probe() and t.probe_interval() == FIRST_PROBE_INTERVAL_S
    assert "a: no readiness probe passed yet" in t.down_reasons()
    t.probed("a")
    assert t.serving() == ["a"] and not t.awaiting_first_probe()
    assert t.probe_interval() == FIRST_PROBE_INTERVAL_S  # b has not passed one yet
    t.probed("b")
    assert t.probe_interval() == RouterSettings().health_probe_interval_s
    say(t, "b", draining=True)  # its record says it drains
    assert t.serving() == ["a"] and "b: draining" in t.down_reasons()
    say(t, "b")
    say(t, "a", health="decode instance a: no prefill instance connected")  # it says why it cannot serve
    assert t.serving() == ["b"] and "a: decode instance a: no prefill instance connected" in t.down_reasons()
    assert {t.pick(journey()) for _ in range(5)} == {"b"}
    t.probed("a")  # ready, but its record still says it cannot serve
    assert t.serving() == ["b"]
    say(t, "a")
    assert sorted(t.serving()) == ["a", "b"]
    assert t.serving(exclude=["a"]) == ["b"]


def test_a_request_waits_only_for_a_target_that_never_served():
    """A starting server: ready, but its decode instance not connected to a prefill instance yet
    (its first record says so): a new request may wait for it. One that served before and
    cannot now is not waited for."""
    t = table("a", up=False)
    say(t, "a", health="no prefill instance connected (none known yet)")
    t.probed("a")
    assert t.serving() == [] and t.awaiting_first_probe()
    say(t, "a")
    assert t.serving() == ["a"] and not t.awaiting_first_probe()
    say(t, "a", health="no prefill instance connected")
    assert t.serving() == [] and not t.awaiting_first_probe()


def test_a_record_older_than_the_one_followed_is_ignored():
    """A fixed decode model reloaded: the new instance's record (started later) is followed, the
    old one's (its lease not lapsed yet) no longer changes anything."""
    t = table("decode_0")
    t.report("decode_0", record("new", health="no prefill instance connected", started=2.0))
    t.report("decode_0", record("old", started=1.0))  # the dead stub's record, written again
    assert t.serving() == []
    t.report("decode_0", record("new", started=2.0))
    assert t.serving() == ["decode_0"]
    t.report("gone", record("gone"))  # not a target: nothing


def test_failures_in_a_row_take_a_target_down_with_its_requests_and_one_pass_brings_it_back():
    t = table("a", "b", health_probe_failures=2)
    on_a = [journey(list(range(40))) for _ in range(2)]
    say(t, "a", cached=list(range(40)))  # a caches the prompts: they go there
    assert [t.pick(j) for j in on_a] == ["a", "a"]
    assert t.failed("a", "Stub process is not healthy") == []  # one failure is not enough
    assert sorted(t.serving()) == ["a", "b"]
    t.probed("a")  # a pass resets the count
    assert t.failed("a", "x") == []
    lost = t.probed("a", "Stub process is not healthy")
    assert set(lost) == set(on_a) and t.serving() == ["b"]
    assert "a: Stub process is not healthy" in t.down_reasons()
    assert t.failed("a", "again") == []  # down already: nothing more to move
    assert t.kv.inflight("a") == 0 and t.in_flight() == []
    t.probed("a")
    assert sorted(t.serving()) == ["a", "b"] and not t.awaiting_first_probe()
    # its cache summary, forgotten while it was down, is back with it
    assert t.pick(journey(list(range(40)))) == "a"
    assert t.probed("gone") == [] and t.failed("gone", "x") == []  # left meanwhile


def test_an_unanswered_probe_does_not_count_while_the_targets_streams_deliver(monkeypatch):
    """A loaded instance on a busy machine answers its streams before its probes: a probe that
    got no answer counts only when the target's streams delivered nothing for
    ``health_probe_timeout_s``; an answered failure always counts."""
    import backend.serving.routing as routing

    now = [1000.0]
    monkeypatch.setattr(routing.time, "monotonic", lambda: now[0])
    t = table("a", "b", health_probe_failures=2, health_probe_timeout_s=5.0)
    on_a = journey()
    assert t.pick(on_a, exclude=["b"]) == "a"
    t.heard("a")  # a response of a's stream was relayed
    now[0] += 4.0
    for _ in range(3):  # within 5 s of it: not counted
        assert t.probed("a", "no answer within 5s", unanswered=True) == []
    assert sorted(t.serving()) == ["a", "b"]
    assert t.probed("a", "decode model decode_0 is not ready") == []  # answered: counts
    now[0] += 1.5  # 5.5 s since a's stream last delivered: unanswered probes count again
    assert t.probed("a", "no answer within 5s", unanswered=True) == [on_a]
    assert t.serving() == ["b"]
    # a target never heard from (b): its unanswered probes count
    assert t.probed("b", "no answer within 5s", unanswered=True) == []
    assert t.probed("b", "no answer within 5s", unanswered=True) == [] and t.serving() == []
    t.heard("gone")  # left meanwhile: nothing


def test_which_errors_move_a_request():
    from backend.engine.outputs import ErrorKind
    from backend.serving.routing import move_reason

    fresh, started = journey(), journey()
    started.sent = [7]
    for kind in (None, ErrorKind.OUT_OF_SERVICE, ErrorKind.DRAINING):
        assert move_reason(kind, fresh) == move_reason(kind, started) == "stream_error"
    assert move_reason(ErrorKind.OVERLOADED, fresh) == "overloaded"
    assert move_reason(ErrorKind.OVERLOADED, started) is None  # the client has output: its answer
    for kind in (ErrorKind.BAD_REQUEST, ErrorKind.ENGINE, ErrorKind.PREFILL_UNAVAILABLE):
        assert move_reason(kind, fresh) is None


def test_an_overloaded_request_with_nowhere_to_go_gets_the_refusal():
    from backend.engine.outputs import ErrorKind

    t = table("a")
    j = journey()
    assert t.pick(j) == "a"
    with pytest.raises(NotMoved) as e:
        t.move(j, "a", "no KV pages free within 10s", "overloaded")
    assert e.value.kind is ErrorKind.OVERLOADED and e.value.message == "no KV pages free within 10s"
    assert t.serving() == ["a"] and t.migrations == {}


def test_a_target_that_leaves_returns_its_requests_and_is_forgotten():
    t = table("a", "b")
    j = journey()
    name = t.pick(j)
    assert name is not None and t.in_flight() == [j]
    assert t.leave(name) == [j] and t.leave(name) == []
    assert name not in t.names() and t.kv.inflight(name) == 0
    other = "b" if name == "a" else "a"
    t.leave(other)
    assert t.down_reasons() == "no decode instance in the deployment" and not t.awaiting_first_probe()


def test_the_pick_prefers_the_target_that_caches_the_prompt_and_counts_the_load():
    prompt = list(range(40))
    t = table("a", "b")
    say(t, "b", cached=prompt)
    for _ in range(3):
        j = journey(prompt, 3)
        assert t.pick(j) == "b"
        t.done("b", j)
    assert t.pick(journey(prompt, 3), exclude=["b"]) == "a"
    status = {s.name: s for s in t.status()}
    assert status["b"].routed == 3 and status["b"].in_flight == 0 and status["a"].in_flight == 1
    assert t.pages(1) == 1 and t.pages(9) == 3  # 4 tokens a page, as b reports
    t.done("gone", journey())  # an attempt on a target that left: nothing to do


def test_a_move_never_goes_back_and_carries_the_output_sent():
    prompt = list(range(40))
    t = table("a", "b", "c")
    say(t, "a", cached=prompt)
    say(t, "b", cached=prompt[:20])
    j = journey(prompt)
    assert t.pick(j) == "a"
    j.sent = [7, 8]
    t.done("a", j)
    assert t.move(j, "a", "connection lost", "stream_error") == "b"
    assert j.route_ids() == prompt + [7, 8] and j.failed == ["a"] and j.moves == 1
    t.done("b", j)
    assert t.move(j, "b", "its stream ended", "stream_error") == "c"
    assert t.migrations == {"stream_error": 2}
    t.done("c", j)
    with pytest.raises(NotMoved) as e:
        t.move(j, "c", "Stub process is not healthy", "instance_down")
    assert "decode instance c: Stub process is not healthy; no other decode instance is serving" in e.value.message
    assert t.migrations == {"stream_error": 2}


def test_past_the_migration_limit_a_request_is_not_moved_and_zero_never_moves():
    t = table("a", "b", "c", migration_limit=1)
    j = journey()
    first = t.pick(j)
    assert first is not None
    second = t.move(j, first, "lost", "instance_down")
    with pytest.raises(NotMoved) as e:
        t.move(j, second, "lost", "instance_down")
    assert "migration limit reached: the request was moved 1 time(s) already (migration_limit 1)" in e.value.message
    assert t.migrations == {"instance_down": 1}
    never = table("a", "b", migration_limit=0)
    j = journey()
    name = never.pick(j)
    assert name is not None
    with pytest.raises(NotMoved, match="migration_limit 0"):
        never.move(j, name, "lost", "stream_error")


def test_the_resume_relays_the_prompt_once_and_sums_the_cumulative_log_probability():
    t = table("a", "b")
    j = journey()
    name = t.pick(j)
    assert name is not None
    assert j.relay_prompt() and not j.relay_prompt()
    assert j.cumulative(-1.5) == -1.5 and j.cumulative(-2.0) == -2.0  # the attempt's running sum
    t.move(j, name, "lost", "stream_error")
    assert j.cumulative(-0.5) == pytest.approx(-2.5)  # the next attempt counts from there
    assert not j.relay_prompt()


def test_what_a_record_says_is_logged_once_per_change(caplog):
    t = table("a")
    with caplog.at_level(logging.INFO, logger="test_routing"):
        say(t, "a", draining=True)
        say(t, "a", draining=True)
        say(t, "a", health="no prefill instance connected")
        say(t, "a", health="no prefill instance connected")
        say(t, "a")
        t.report("a", dataclasses.replace(record("a"), cache="{"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count("decode instance a drains: no new requests") == 1
    assert lines.count("decode instance a cannot serve (no prefill instance connected); no new requests go there") == 1
    assert lines.count("decode instance a serves") == 1
    assert any("unreadable cache summary in its record" in m for m in lines)  # routed by load there
    assert t.serving() == ["a"]


def test_membership_records_become_targets_and_a_moved_or_departed_one_hands_back_its_requests():
    t = RoutingTable(RouterSettings(), log)
    assert t.update([record("x"), record("y", url="b:8001")], []) == []
    assert t.target("y") == Target("y", "b:8001", "decode_0") and sorted(t.names()) == ["x", "y"]
    for n in ("x", "y"):
        t.probed(n)
    j = journey()
    where = t.pick(j, exclude=["x"])
    assert where == "y"
    # the same record again (its lease renewed, say): nothing moves; draining: no new requests
    assert t.update([record("y", url="b:8001", draining=True)], []) == []
    assert t.serving() == ["x"] and t.target("y") is not None
    # a new address: the requests in flight at the old one move; it must pass a probe again
    assert t.update([record("y", url="c:8001")], []) == [("y", "its record changed address", [j])]
    assert t.target("y") == Target("y", "c:8001", "decode_0") and t.serving() == ["x"]
    j2 = journey()
    t.probed("y")
    assert t.pick(j2, exclude=["x"]) == "y"
    assert t.update([], [record("y", url="c:8001")]) == [("y", "it left the membership", [j2])]
    assert t.target("y") is None and t.names() == ["x"]
    assert t.update([], [record("y")]) == []  # gone already
    t.join("decode_3")  # a fixed decode model: on the router's own server
    assert t.target("decode_3") == Target("decode_3", "", "decode_3")
