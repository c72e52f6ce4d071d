"""The routing and migration core that both fronts share: the Triton front model
(``backend/triton/front_model.py``, threads, gRPC or BLS calls) and the OpenAI frontend
(``backend/openai/router.py``, asyncio, gRPC) are thin adapters over it that only open streams,
probe and relay responses. Nothing here knows a transport.

Targets (decode instances) and their health: a target joins (from the membership, or the front
model's ``decode_models``) and is routable once a readiness probe passed (Triton's own model
readiness, a control call: nothing goes through the decode model's inputs). What an instance
says of itself comes in its membership record (:meth:`RoutingTable.report`): ``draining`` (no
new requests, those in flight go on), ``health`` (why it cannot serve now, e.g. no prefill
instance connected: no new requests until its record says otherwise) and its cache summary (the
KV-aware pick). A target is down while ``health_probe_failures`` probes in a row failed (a
stream that a target ends in a way that is not the request's fault, e.g. a dead stub, counts as
a failed probe too; a probe that got no answer does not count while the target's streams still
deliver responses), and gone once its record left (its lease lapsed: the process died). When a
target goes down or leaves, the requests in flight on it are returned to the adapter, which
moves them (a dead instance never answers them). One passing probe brings it back.

The pick (:class:`KVRouter`): among the serving targets not excluded, the one with the lowest
``kv_routing_weight`` x (prompt pages not cached there) + (pages of requests in flight there).

A request across its attempts is a :class:`Journey`: the prompt, the output tokens its client
has (they go to the next target as ``resume_token_ids``: the stream continues there, no token
repeated or lost, a guided request's grammar replays them), the targets that failed it (never
picked again for it), whether the prompt's log-probabilities reached the client (they are
relayed once) and the output's cumulative log-probability of earlier attempts (summed into
``cum_log_probs``). :meth:`RoutingTable.move` moves it at most ``migration_limit`` times, then,
as when no other target serves, raises :class:`NotMoved` with the client's error message.
Moves are counted by reason (``REASONS``).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from backend.cluster.records import InstanceRecord
from backend.engine.cache_summary import CacheSummary
from backend.engine.outputs import ErrorKind
from backend.serving.config import RouterSettings
from backend.serving.kv_router import KVRouter

# why a request moved (the migrations counter's label): its target went down or left, its
# stream failed or ended early in a way that is not the request's fault, or its target had no
# KV pages for it in time (overloaded) before it sent any output
REASONS = ("instance_down", "stream_error", "overloaded")
# error kinds that say the target, not the request, failed (or takes nothing new: draining): the
# request moves (an error without a kind is Triton's own, e.g. a dead stub's)
MOVABLE = (None, ErrorKind.OUT_OF_SERVICE, ErrorKind.DRAINING)
NEVER_PROBED = "no readiness probe passed yet"
FIRST_PROBE_INTERVAL_S = 0.1
FIRST_PICK_POLL_S = 0.02  # how often a request that waits for a first passing probe looks again


def move_reason(kind: ErrorKind | None, journey: Journey) -> str | None:
    """Why an attempt that ended with an error of ``kind`` moves (a :data:`REASONS` label), or
    None when the error is the client's answer. An ``overloaded`` refusal (the target had no KV
    pages for it within its wait) moves only while no output reached the client: another target
    may have room (one the autoscaler just added, say); when none serves, the client gets the
    refusal itself."""
    if kind in MOVABLE:
        return "stream_error"
    if kind is ErrorKind.OVERLOADED and not journey.sent:
        return "overloaded"
    return None


@dataclass(frozen=True)
class Target:
    """Where a target is: ``name`` (its membership record's, or the front model's decode model),
    reached at ``grpc_url`` (Triton's gRPC host:port; "" for the router's own server) as Triton
    model ``model``."""

    name: str
    grpc_url: str
    model: str


@dataclass(eq=False)
class Journey:
    """One client request across its attempts (also its identity in the KV router)."""

    request_id: str
    prompt_ids: list[int]
    pages: int  # the KV pages it holds on a target (prompt plus output)
    sent: list[int] = field(default_factory=list)  # output tokens its client has
    failed: list[str] = field(default_factory=list)  # targets that failed it, in order
    prompt_relayed: bool = False  # the prompt's log-probabilities reached the client
    cum_before: float = 0.0  # the output's cumulative log-probability over earlier attempts
    cum: float = 0.0  # ... and the current one, as relayed
    cache_salt: str = ""  # its prefix-cache tenant: only pages cached under it match

    @property
    def moves(self) -> int:
        return len(self.failed)

    def route_ids(self) -> list[int]:
        """What a target would have to hold to continue it: the prompt and the output sent."""
        return self.prompt_ids + self.sent

    def relay_prompt(self) -> bool:
        """True for the first attempt's prompt log-probabilities; a later attempt's are dropped."""
        first = not self.prompt_relayed
        self.prompt_relayed = True
        return first

    def cumulative(self, attempt_cum: float) -> float:
        """``cum_log_probs`` as the client sees it: earlier attempts' plus this one's."""
        self.cum = self.cum_before + attempt_cum
        return self.cum


class NotMoved(Exception):
    """The request cannot move on: ``message`` is its error for the client, of ``kind`` (out of
    service; overloaded when an overloaded refusal found no other target)."""

    def __init__(self, message: str, kind: ErrorKind = ErrorKind.OUT_OF_SERVICE):
        super().__init__(message)
        self.message, self.kind = message, kind


@dataclass(eq=False)
class TargetState:
    name: str
    draining: bool = False  # its membership record says so
    out: str = ""  # its record says it cannot serve now, and why
    up: bool = False  # its last readiness probes pass (routable unless its record says otherwise)
    passed: bool = False  # a probe of it passed once
    served: bool = False  # it was serving once (ready, and its record said it can)
    failures: int = 0  # failed probes (and streams) in a row
    reason: str = NEVER_PROBED
    heard: float = -math.inf  # when a stream of it last delivered a response (monotonic)
    routed: int = 0  # attempts sent to it
    in_flight: set[Journey] = field(default_factory=set)
    started: float = -math.inf  # ``started_at`` of the record it follows
    summary: CacheSummary | None = None  # the cache summary of that record

    @property
    def serving(self) -> bool:
        return self.up and not (self.draining or self.out)


@dataclass(frozen=True)
class TargetStatus:
    name: str
    up: bool
    serving: bool  # up and not draining
    routed: int
    in_flight: int


class RoutingTable:
    """Targets, their health, the pick and the moves, behind one lock (callable from any
    thread, or from an event loop: nothing here blocks). ``noun`` names a target in messages."""

    def __init__(self, settings: RouterSettings, log: logging.Logger, noun: str = "decode instance"):
        self.settings, self.log, self.noun = settings, log, noun
        self.kv = KVRouter(settings.kv_routing_weight)
        self.migrations: Counter[str] = Counter()
        self._targets: dict[str, TargetState] = {}
        self._where: dict[str, Target] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ membership
    def update(
        self, joined: Iterable[InstanceRecord], left: Iterable[InstanceRecord]
    ) -> list[tuple[str, str, list[Journey]]]:
        """Membership records that joined or changed (``draining``, ``health``, ``cache``, or an
        address: the requests in flight at the old one move), and records that left. Returns the
        requests in flight to move: (target, why, requests)."""
        lost: list[tuple[str, str, list[Journey]]] = []
        for record in joined:
            target = Target(record.name, record.grpc_url, record.model)
            known = self.target(record.name)
            if known != target:
                if known is not None:
                    lost.append((record.name, "its record changed address", self.leave(record.name)))
                self.log.info("%s %s joined: model %s at %s", self.noun, record.name, record.model, record.grpc_url)
            self.join(target)
            self.report(record.name, record)
        for record in left:
            if self.target(record.name) is not None:
                lost.append((record.name, "it left the membership", self.leave(record.name)))
        return lost

    def target(self, name: str) -> Target | None:
        """Where ``name`` is; None once it left."""
        with self._lock:
            return self._where.get(name)

    def join(self, target: Target | str) -> None:
        """``target`` is a target (routable after its first passing probe); a bare name is the
        decode model of that name on the router's own server."""
        if isinstance(target, str):
            target = Target(target, "", target)
        with self._lock:
            self._where[target.name] = target
            self._targets.setdefault(target.name, TargetState(target.name))

    def report(self, name: str, record: InstanceRecord) -> None:
        """What a membership record says of target ``name`` (its own, or, for a fixed decode
        model, the record of the instance serving it): whether it drains, why it cannot serve
        (``health``), its cache summary (``cache``). A record that started before the one
        followed is ignored (a reloaded decode model's old record, whose lease has not lapsed)."""
        summary = self._read_summary(name, record.cache)
        with self._lock:
            state = self._targets.get(name)
            if state is None or record.started_at < state.started:
                return
            state.started, state.summary = record.started_at, summary
            was_draining, was_out = state.draining, state.out
            state.draining, state.out = record.draining, record.health
            state.served = state.served or state.serving
        if summary is not None:
            self.kv.update(name, summary)
        if record.health and not was_out:
            self.log.warning("%s %s cannot serve (%s); no new requests go there", self.noun, name, record.health)
        elif record.health and record.health != was_out:
            self.log.debug("%s %s still cannot serve (%s)", self.noun, name, record.health)
        elif record.draining and not was_draining:
            self.log.info("%s %s drains: no new requests", self.noun, name)
        elif not (record.health or record.draining) and (was_out or was_draining):
            self.log.info("%s %s serves", self.noun, name)

    def _read_summary(self, name: str, cache: str) -> CacheSummary | None:
        if not cache:
            return None
        try:
            return CacheSummary.from_json(json.loads(cache))
        except ValueError as e:
            self.log.warning(
                "%s %s: unreadable cache summary in its record (%s); routing by load there", self.noun, name, e
            )
            return None

    def leave(self, name: str) -> list[Journey]:
        """``name`` left: the requests in flight there, to move."""
        with self._lock:
            state = self._targets.pop(name, None)
            self._where.pop(name, None)
        self.kv.forget(name)
        if state is None:
            return []
        self.log.info("%s %s left the membership", self.noun, name)
        return list(state.in_flight)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._targets)

    # ------------------------------------------------------------ health
    def heard(self, name: str) -> None:
        """A stream of ``name`` delivered a response: it is alive (adapters call this per
        response relayed)."""
        with self._lock:
            state = self._targets.get(name)
            if state is not None:
                state.heard = time.monotonic()

    def probed(self, name: str, error: str | None = None, unanswered: bool = False) -> list[Journey]:
        """A readiness probe of ``name`` passed, or failed with ``error``; ``unanswered``: it got
        no answer (none within ``health_probe_timeout_s``, or the call broke). An unanswered probe
        of a target whose streams delivered a response within the last ``health_probe_timeout_s``
        does not count: it is alive, only slow to answer. Returns the requests in flight there
        when this took it down (to move)."""
        if error is not None and unanswered and self._heard_within(name, self.settings.health_probe_timeout_s):
            self.log.debug("%s %s: probe unanswered (%s) but its streams deliver; not counted", self.noun, name, error)
            return []
        if error is not None:
            return self.failed(name, error)
        with self._lock:
            state = self._targets.get(name)
            if state is None:
                return []  # left meanwhile
            back = not state.up
            state.up, state.passed, state.failures, state.reason = True, True, 0, ""
            state.served = state.served or state.serving
            summary = state.summary
        if summary is not None:
            self.kv.update(name, summary)  # forgotten while it was down
        if back:
            self.log.warning("%s %s is ready; routing to it", self.noun, name)
        return []

    def _heard_within(self, name: str, seconds: float) -> bool:
        with self._lock:
            state = self._targets.get(name)
            return state is not None and time.monotonic() - state.heard <= seconds

    def failed(self, name: str, why: str) -> list[Journey]:
        """A failed probe of ``name``, or a stream it ended in a way that is not the request's
        fault: ``health_probe_failures`` in a row take it down. Returns the requests in flight
        there when this took it down (to move)."""
        with self._lock:
            state = self._targets.get(name)
            if state is None:
                return []
            state.failures += 1
            state.reason = why
            if not (state.up and state.failures >= self.settings.health_probe_failures):
                return []
            state.up = False
            lost, state.in_flight = list(state.in_flight), set()
        self.kv.forget(name)  # it may come back with an empty cache
        self.log.error(
            "%s %s is down (%s); routing around it, moving its %d request(s)", self.noun, name, why, len(lost)
        )
        return lost

    def awaiting_first_probe(self) -> bool:
        """No target serves, but one has never served (it may, in a moment: a server starting,
        whose readiness has not passed yet or whose decode instances are not connected to a
        prefill instance yet). A new request may wait for it, at most ``health_probe_timeout_s``;
        otherwise it fails at once."""
        with self._lock:
            states = list(self._targets.values())
            return not any(s.serving for s in states) and any(not s.served for s in states)

    def probe_interval(self) -> float:
        """How long until the next round of probes: ``FIRST_PROBE_INTERVAL_S`` while a target has
        never passed one (so that a starting one serves soon after it can), else
        ``health_probe_interval_s``."""
        with self._lock:
            waiting = any(not s.passed for s in self._targets.values())
        interval = self.settings.health_probe_interval_s
        return min(interval, FIRST_PROBE_INTERVAL_S) if waiting else interval

    # ------------------------------------------------------------ routing
    def serving(self, exclude: Iterable[str] = ()) -> list[str]:
        with self._lock:
            return self._serving(exclude)

    def _serving(self, exclude: Iterable[str]) -> list[str]:  # the lock held
        skip = set(exclude)
        return [s.name for s in self._targets.values() if s.serving and s.name not in skip]

    def pick(self, journey: Journey, exclude: Iterable[str] = ()) -> str | None:
        """The serving target (not in ``exclude``) the KV router prefers for ``journey``; it is in
        flight there until :meth:`done`. None if none serves."""
        with self._lock:
            name = self.kv.pick(journey, journey.route_ids(), self._serving(exclude), journey.pages, journey.cache_salt)
            if name is not None:
                state = self._targets[name]
                state.routed += 1
                state.in_flight.add(journey)
            return name

    def done(self, name: str, journey: Journey) -> None:
        """``journey``'s attempt on ``name`` ended."""
        with self._lock:
            state = self._targets.get(name)
            if state is not None:
                state.in_flight.discard(journey)
        self.kv.done(name, journey)

    def move(self, journey: Journey, name: str, why: str, reason: str) -> str:
        """``journey``'s attempt on ``name`` ended, ``why``, without finishing it: the target it
        continues on (never one that failed it before), or :class:`NotMoved` (for an
        ``overloaded`` one, with the refusal itself when it cannot move)."""
        journey.failed.append(name)
        limit = self.settings.migration_limit
        where = f"{self.noun} {name}: {why}"
        retry = self.pick(journey, exclude=journey.failed) if journey.moves <= limit else None
        if retry is None and reason == "overloaded":
            raise NotMoved(why, ErrorKind.OVERLOADED)  # not moved: the refusal is the answer
        if journey.moves > limit:
            raise NotMoved(
                f"{where}; migration limit reached: the request was moved {limit} time(s) already "
                f"(migration_limit {limit}), so it is not moved again"
            )
        if retry is None:
            raise NotMoved(f"{where}; no other {self.noun} is serving ({self.down_reasons()})")
        journey.cum_before = journey.cum  # the next attempt sums only the output it makes
        self.migrations[reason] += 1
        self.log.warning(
            "request %s moves from %s to %s after %d output token(s) sent (%s: %s); move %d of %d",
            journey.request_id,
            name,
            retry,
            len(journey.sent),
            reason,
            why,
            journey.moves,
            limit,
        )
        return retry

    def pages(self, n_tokens: int) -> int:
        """The KV pages ``n_tokens`` tokens take on a target (its reported page size)."""
        return max(1, -(-n_tokens // self.kv.page_size()))

    # ------------------------------------------------------------ what it knows
    def down_reasons(self) -> str:
        """Why targets do not serve, for an error message."""
        with self._lock:
            parts = [f"{s.name}: {_why_not(s)}" for s in self._targets.values() if not s.serving]
        return "; ".join(parts) or f"no {self.noun} in the deployment"

    def in_flight(self) -> list[Journey]:
        with self._lock:
            return [j for s in self._targets.values() for j in s.in_flight]

    def status(self) -> list[TargetStatus]:
        with self._lock:
            return [TargetStatus(s.name, s.up, s.serving, s.routed, len(s.in_flight)) for s in self._targets.values()]


def _why_not(state: TargetState) -> str:
    """Why a target that does not serve does not."""
    if not state.up:
        return state.reason
    return state.out or "draining"
