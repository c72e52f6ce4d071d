"""The request state machines (``backend/serving/request_state.py``): every allowed transition of
each role's table leads where the table says, every other (state, event) pair is refused."""

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
