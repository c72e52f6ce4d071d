"""The request state machines (``backend/serving/request_state.py``): the tables against an
independent statement of each role's lifecycle (the paths a request may take, written below as
event sequences with the state each event leads to, from the module's lifecycle diagram and
``backend/README.md``, not from the tables): every path runs as stated, and the paths together
use every entry of the table and no other, so a wrong, missing or extra entry fails; every other
(state, event) pair is refused."""

from __future__ import annotations

import pytest

from backend.serving.request_state import (
    DECODE_TRANSITIONS,
    PREFILL_TRANSITIONS,
    DecodeEvent,
    DecodeState,
    IllegalTransition,
    PrefillEvent,
    PrefillState,
    RequestState,
)

# Each path: a request's life from QUEUED, as "EVENT>STATE" steps (STATE: where the event leads).
DECODE_PATHS = {
    "remote prefill, KV lands": "KV_NEEDED>WAITING_KV PREFILL_STARTED>WAITING_KV KV_LANDED>RUNNING "
    "ENGINE_FINISHED>FINISHED",
    "computed here": "LOCAL>RUNNING ENGINE_FINISHED>FINISHED",
    "cancelled in the queue": "CANCEL>QUEUED ENGINE_FINISHED>FINISHED",
    "no prefill instance": "KV_NEEDED>WAITING_KV NO_PREFILL>FINISHED",
    "late messages while running, cancelled": "LOCAL>RUNNING PREFILL_STARTED>RUNNING PREFILL_FAILED>RUNNING "
    "CANCEL>RUNNING ENGINE_FINISHED>FINISHED",
    "load failed, released": "KV_NEEDED>WAITING_KV PREFILL_FAILED>WAITING_KV KV_FAILED>RELEASING "
    "ENGINE_FINISHED>RELEASING CANCEL>RELEASING PREFILL_STARTED>RELEASING PREFILL_FAILED>RELEASING "
    "KV_RELEASED>FINISHED",
    "load failed, recomputed here": "KV_NEEDED>WAITING_KV KV_FAILED>RELEASING RECOMPUTE>RECOVERING "
    "PREFILL_STARTED>RECOVERING PREFILL_FAILED>RECOVERING KV_RELEASED>WAITING_KV LOCAL>RUNNING "
    "ENGINE_FINISHED>FINISHED",
    "load failed, another prefill instance": "KV_NEEDED>WAITING_KV KV_FAILED>RELEASING RECOMPUTE>RECOVERING "
    "KV_RELEASED>WAITING_KV KV_LANDED>RUNNING ENGINE_FINISHED>FINISHED",
    "cancelled while recovering": "KV_NEEDED>WAITING_KV KV_FAILED>RELEASING RECOMPUTE>RECOVERING "
    "CANCEL>RELEASING KV_RELEASED>FINISHED",
    "engine ended while recovering": "KV_NEEDED>WAITING_KV KV_FAILED>RELEASING RECOMPUTE>RECOVERING "
    "ENGINE_FINISHED>RELEASING KV_RELEASED>FINISHED",
    "cancelled waiting, KV lands anyway": "KV_NEEDED>WAITING_KV CANCEL>CANCELLING PREFILL_STARTED>CANCELLING "
    "KV_LANDED>FINISHED",
    "cancelled waiting, receive fails": "KV_NEEDED>WAITING_KV CANCEL>CANCELLING CANCEL>CANCELLING "
    "ENGINE_FINISHED>CANCELLING PREFILL_FAILED>CANCELLING KV_FAILED>RELEASING KV_RELEASED>FINISHED",
    "engine ended while waiting": "KV_NEEDED>WAITING_KV ENGINE_FINISHED>CANCELLING KV_LANDED>FINISHED",
}
PREFILL_PATHS = {
    "prefilled and sent": "STARTED>RUNNING ENGINE_FINISHED>SENDING FREEABLE>FINISHED",
    "cancelled while running": "STARTED>RUNNING CANCEL>RUNNING ENGINE_FINISHED>SENDING CANCEL>SENDING "
    "FREEABLE>FINISHED",
    "cancelled in the queue": "CANCEL>QUEUED ENGINE_FINISHED>SENDING FREEABLE>FINISHED",
}


@pytest.mark.parametrize(
    ("paths", "table", "states", "events"),
    [
        (DECODE_PATHS, DECODE_TRANSITIONS, DecodeState, DecodeEvent),
        (PREFILL_PATHS, PREFILL_TRANSITIONS, PrefillState, PrefillEvent),
    ],
    ids=["decode", "prefill"],
)
def test_the_table_is_the_lifecycle(paths, table, states, events):
    used = {}
    for name, path in paths.items():
        r = RequestState(name, table, states.QUEUED)
        for step in path.split():
            event, want = step.split(">")
            before = r.state
            r.apply(events[event])
            assert r.state is states[want], f"{name}: {event} in {before.name} led to {r.state.name}, not {want}"
            used[(before, events[event])] = states[want]
        assert r.finished, name
    missing = {f"{s.name}+{e.name}" for s, e in set(table) - set(used)}
    assert used == table, f"table entries no stated path takes: {sorted(missing)}"


ROLES = [
    (DECODE_TRANSITIONS, DecodeState, DecodeEvent, DecodeState.FINISHED),
    (PREFILL_TRANSITIONS, PrefillState, PrefillEvent, PrefillState.FINISHED),
]


@pytest.mark.parametrize("table,states,events,terminal", ROLES)
def test_walk_every_pair_of_the_table(table, states, events, terminal):
    allowed = refused = 0
    for state in states:
        for event in events:
            r = RequestState("r", table, state)
            if (state, event) in table:
                assert r.apply(event) is state and r.state is table[(state, event)]
                allowed += 1
            else:
                with pytest.raises(IllegalTransition, match=f"{event.name} is not allowed in state {state.name}"):
                    r.apply(event)
                assert r.state is state  # a refused event changes nothing
                refused += 1
    assert allowed == len(table) and refused == len(states) * len(events) - len(table)
    assert not any(s is terminal for s, _ in table)  # nothing leaves the terminal state


@pytest.mark.parametrize("table,states,events,terminal", ROLES)
def test_every_state_is_reachable_and_can_finish(table, states, events, terminal):
    initial = states.QUEUED
    reached, frontier = {initial}, [initial]
    while frontier:
        s = frontier.pop()
        for (src, _), dst in table.items():
            if src is s and dst not in reached:
                reached.add(dst)
                frontier.append(dst)
    assert reached == set(states)
    for state in states:  # from every state some path ends the request
        seen, frontier = {state}, [state]
        while frontier and terminal not in seen:
            s = frontier.pop()
            for (src, _), dst in table.items():
                if src is s and dst not in seen:
                    seen.add(dst)
                    frontier.append(dst)
        assert terminal in seen, state


def test_decode_paths():
    remote = RequestState.decode("a")
    for e in (DecodeEvent.KV_NEEDED, DecodeEvent.PREFILL_STARTED, DecodeEvent.KV_LANDED, DecodeEvent.ENGINE_FINISHED):
        remote.apply(e)
    assert remote.finished and remote.history == [
        DecodeState.QUEUED,
        DecodeState.WAITING_KV,
        DecodeState.RUNNING,
        DecodeState.FINISHED,
    ]
    cancelled = RequestState.decode("b")
    for e in (DecodeEvent.KV_NEEDED, DecodeEvent.CANCEL, DecodeEvent.ENGINE_FINISHED, DecodeEvent.KV_FAILED):
        cancelled.apply(e)
    assert cancelled.state is DecodeState.RELEASING  # pages held until no write can land
    with pytest.raises(IllegalTransition):
        cancelled.apply(DecodeEvent.KV_LANDED)  # a completion after the receive failed: refused
    cancelled.apply(DecodeEvent.KV_RELEASED)
    assert cancelled.finished
    with pytest.raises(IllegalTransition):
        cancelled.apply(DecodeEvent.KV_RELEASED)  # a duplicate: refused


def test_prefill_paths():
    r = RequestState.prefill("p")
    for e in (PrefillEvent.STARTED, PrefillEvent.CANCEL, PrefillEvent.ENGINE_FINISHED, PrefillEvent.FREEABLE):
        r.apply(e)
    assert r.finished
    with pytest.raises(IllegalTransition):
        RequestState.prefill("q").apply(PrefillEvent.FREEABLE)  # pages are freed only after the engine let go
