"""The frontend's router: which decode instance of the deployment a request goes to, and where it
goes next when that instance stops serving it (request migration).

It knows the decode instances of the membership (:meth:`Router.update`, records from etcd) and
their health (:meth:`Router.probed`, one health probe a second each, with its cache summary). A
request goes to a member that is not draining and whose probes pass, the one the
:class:`KVRouter` finds cheapest for its prompt (``backend/serving/kv_router.py``: prompt pages
not cached there, pages in flight there). A member is routable after its first passing probe;
``probe_failures`` failed probes in a row take it down, and so does leaving the membership: its
requests in flight move at once (a dead instance would never answer them; reason
``instance_down``).

:meth:`Router.generate` relays one request as one stream of deltas. When its stream fails with an
error of kind None (Triton's own, e.g. a dead stub) or ``out_of_service``, breaks (gRPC
unavailable, connection lost) or ends without a final response (reason ``stream_error``), the
request continues on another member, never one that failed it before, with every output token
its client has received as ``resume_token_ids``: the decode model continues after them (counts,
grammar, detokenizer) and sends only what follows, so the client sees no token repeated or lost.
Log-probabilities follow the tokens they belong to; the prompt's (asked for with ``echo``) come
once, in the first response relayed: an attempt after that is not asked for them
(:meth:`DecodeFleet.generate` asks only while no output token was sent) and any it sends
anyway are dropped here.
At most ``migration_limit`` moves; then, as when no other member serves, the stream ends with an
``out_of_service`` error saying why. Any other error (bad request, overloaded, ...) is the
request's answer and ends it as is.

Everything here runs on the frontend's event loop (membership changes are handed to it); opening
a stream is the caller's (``OpenStream``), so the logic runs in unit tests with fake targets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from backend.cluster.records import InstanceRecord
from backend.engine.cache_summary import CacheSummary
from backend.engine.outputs import ErrorKind
from backend.openai.triton_stream import Delta, GenerationError, StreamLost
from backend.serving.config import RouterSettings
from backend.serving.kv_router import KVRouter

log = logging.getLogger("triton_disagg.openai")

REASONS = ("instance_down", "stream_error")  # why a request moved (the migrations counter's label)
# error kinds that say the instance, not the request, failed (or takes nothing new: draining)
MOVABLE = (None, ErrorKind.OUT_OF_SERVICE, ErrorKind.DRAINING)


@dataclass(frozen=True)
class Target:
    """A decode model instance: ``name`` its membership record's, reached at ``grpc_url``
    (Triton's gRPC host:port) as Triton model ``model``."""

    name: str
    grpc_url: str
    model: str


@dataclass(frozen=True)
class TargetStatus:
    target: Target
    up: bool  # its probes pass
    draining: bool
    routed: int  # requests (attempts) sent to it


# opens one attempt of a request on a target, after the output the client already has
OpenStream = Callable[[Target, list[int]], AsyncIterator[Delta]]


@dataclass(eq=False)
class _Member:
    target: Target
    draining: bool
    up: bool = False
    failures: int = 0  # failed probes in a row
    reason: str = "no health probe answered yet"
    routed: int = 0
    attempts: set[_Attempt] = field(default_factory=set)


@dataclass(eq=False)
class _Attempt:
    """A request's stream on one member; ``lost`` is set when the member went down under it."""

    lost: asyncio.Event = field(default_factory=asyncio.Event)
    why: str = ""


@dataclass(eq=False)
class _Journey:
    """One request across its attempts (also its identity in the KV router): ``sent`` the output
    tokens its client has, ``failed`` the members that failed it."""

    request_id: str
    prompt_ids: list[int]
    pages: int
    sent: list[int] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    prompt_relayed: bool = False  # the prompt's log-probabilities reached the client


class _Moved(Exception):
    """An attempt ended without finishing its request, for a reason that lets it move."""

    def __init__(self, reason: str, why: str):
        super().__init__(why)
        self.reason, self.why = reason, why


class Router:
    """``update(joined, left)`` with membership records, ``probed(name, summary, error)`` with
    each probe's outcome; ``generate(...)`` relays a request; ``migrations`` counts moves by
    reason; ``status()`` lists the members. ``settings``: the router settings the Triton front
    model has too (``RouterSettings``: probes, KV-routing weight, migration limit)."""

    def __init__(self, settings: RouterSettings | None = None):
        self.settings = settings = settings or RouterSettings()
        self.migration_limit = settings.migration_limit
        self.probe_failures = settings.health_probe_failures
        self.kv = KVRouter(settings.kv_routing_weight)
        self.migrations: Counter[str] = Counter()
        self._members: dict[str, _Member] = {}

    # ------------------------------------------------------------ membership and health
    def update(self, joined: Iterable[InstanceRecord], left: Iterable[InstanceRecord]) -> None:
        """Records that joined or changed (``draining``), and records that left (their requests
        in flight move)."""
        for record in joined:
            target = Target(record.name, record.grpc_url, record.model)
            member = self._members.get(record.name)
            if member is None or member.target != target:
                if member is not None:
                    self._lose(member, "its record changed address")
                self._members[record.name] = _Member(target, record.draining)
                log.info("decode instance %s joined: model %s at %s", record.name, record.model, record.grpc_url)
            elif member.draining != record.draining:
                member.draining = record.draining
                log.info(
                    "decode instance %s %s", record.name, "drains: no new requests" if record.draining else "serves"
                )
        for record in left:
            gone = self._members.pop(record.name, None)
            if gone is not None:
                log.info("decode instance %s left the membership", record.name)
                self._lose(gone, "it left the membership")
                self.kv.forget(record.name)

    def probed(self, name: str, summary: CacheSummary | None, error: str | None) -> None:
        """The outcome of a health probe of ``name``: its cache summary (None: it sent none) or
        why it failed. One pass makes it routable; ``probe_failures`` failures in a row take it
        down."""
        member = self._members.get(name)
        if member is None:
            return  # left meanwhile
        if error is None:
            if not member.up:
                log.info(
                    "decode instance %s (%s at %s) serves; routing to it",
                    name,
                    member.target.model,
                    member.target.grpc_url,
                )
            member.up, member.failures, member.reason = True, 0, ""
            if summary is not None:
                self.kv.update(name, summary)
            return
        member.failures += 1
        member.reason = error
        if member.up and member.failures >= self.probe_failures:
            member.up = False
            self.kv.forget(name)
            log.error("decode instance %s is down (%s); routing around it", name, error)
            self._lose(member, f"its health probes failed ({error})")

    def _lose(self, member: _Member, why: str) -> None:
        for attempt in member.attempts:
            attempt.why = why
            attempt.lost.set()

    def targets(self) -> list[Target]:
        return [m.target for m in self._members.values()]

    def serving(self, exclude: Iterable[str] = ()) -> list[Target]:
        """The members a new request may go to: up, not draining, not in ``exclude``."""
        skip = set(exclude)
        return [m.target for m in self._members.values() if m.up and not m.draining and m.target.name not in skip]

    def down_reasons(self) -> str:
        """Why members do not serve, for an error message."""
        parts = [
            f"{m.target.name}: {'draining' if m.draining and m.up else m.reason}"
            for m in self._members.values()
            if not m.up or m.draining
        ]
        return "; ".join(parts) or "no decode instance in the membership"

    def status(self) -> list[TargetStatus]:
        return [TargetStatus(m.target, m.up, m.draining, m.routed) for m in self._members.values()]

    # ------------------------------------------------------------ routing
    def pick(self, request: object, token_ids: Sequence[int], pages: int, exclude: Iterable[str] = ()) -> Target | None:
        """The serving member (not in ``exclude``) the KV router prefers for the prompt
        ``token_ids``; the request counts as in flight there (``pages`` pages) until
        :meth:`done`. None if no member serves."""
        candidates = [t.name for t in self.serving(exclude)]
        name = self.kv.pick(request, token_ids, candidates, pages)
        if name is None:
            return None
        member = self._members[name]
        member.routed += 1
        return member.target

    def done(self, target: Target, request: object) -> None:
        self.kv.done(target.name, request)

    def pages(self, n_tokens: int) -> int:
        """The KV pages ``n_tokens`` tokens take on a decode instance (its reported page size)."""
        return max(1, -(-n_tokens // self.kv.page_size()))

    async def generate(
        self, request_id: str, token_ids: list[int], max_tokens: int, open_stream: OpenStream
    ) -> AsyncGenerator[Delta, None]:
        """The request's deltas until the one with a finish reason, across as many members as it
        takes (at most ``migration_limit`` moves); :class:`GenerationError` when it fails for
        good. ``token_ids``: its prompt, for routing (empty: by load alone). Closing the
        iterator early closes the open stream (which cancels the request there)."""
        journey = _Journey(request_id, list(token_ids), self.pages(len(token_ids) + max_tokens))
        target = self.pick(journey, token_ids, journey.pages)
        if target is None:
            raise GenerationError(ErrorKind.OUT_OF_SERVICE, f"no decode instance is serving ({self.down_reasons()})")
        while True:
            try:
                stream = open_stream(target, list(journey.sent))
                # closed explicitly (aclosing): a client that leaves must cancel the call at once
                async with contextlib.aclosing(self._attempt(target, journey, stream)) as deltas:
                    async for delta in deltas:
                        journey.sent.extend(delta.token_ids)
                        if delta.prompt_token_ids is not None:
                            if journey.prompt_relayed:
                                delta = delta.without_prompt()  # sent by an earlier attempt
                            journey.prompt_relayed = True
                        yield delta
                        if delta.finish_reason is not None:
                            return
                raise _Moved("stream_error", "its stream ended before the request finished")
            except _Moved as moved:
                target = self._move(journey, target, moved)

    def _move(self, journey: _Journey, target: Target, moved: _Moved) -> Target:
        """Where the request goes after ``target`` failed it, or the error that ends it."""
        journey.failed.append(target.name)
        limit = self.migration_limit
        where = f"decode instance {target.name} ({target.model} at {target.grpc_url}): {moved.why}"
        if len(journey.failed) > limit:
            raise GenerationError(
                ErrorKind.OUT_OF_SERVICE,
                f"{where}; migration limit reached: the request was moved {limit} time(s) already "
                f"(--migration-limit {limit}), so it is not moved again",
            )
        retry = self.pick(journey, journey.prompt_ids + journey.sent, journey.pages, exclude=journey.failed)
        if retry is None:
            raise GenerationError(
                ErrorKind.OUT_OF_SERVICE, f"{where}; no other decode instance is serving ({self.down_reasons()})"
            )
        self.migrations[moved.reason] += 1
        log.warning(
            "request %s moves from %s to %s after %d output token(s) sent (%s: %s); move %d of %d",
            journey.request_id,
            target.name,
            retry.name,
            len(journey.sent),
            moved.reason,
            moved.why,
            len(journey.failed),
            limit,
        )
        return retry

    async def _attempt(
        self, target: Target, journey: _Journey, stream: AsyncIterator[Delta]
    ) -> AsyncGenerator[Delta, None]:
        """One attempt's deltas; raises :class:`_Moved` when the request may continue elsewhere
        (its member went down, or the stream failed in a way that is not the request's)."""
        attempt = _Attempt()
        member = self._members.get(target.name)
        if member is not None:
            member.attempts.add(attempt)
        lost = asyncio.ensure_future(attempt.lost.wait())
        try:
            while True:
                step = asyncio.ensure_future(anext(stream))
                try:
                    await asyncio.wait({step, lost}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not step.done():  # lost, or this task was cancelled: stop reading
                        step.cancel()
                        with contextlib.suppress(BaseException):
                            await step
                if not step.done() or step.cancelled():
                    raise _Moved("instance_down", attempt.why)
                try:
                    delta = step.result()
                except StopAsyncIteration:
                    return
                except StreamLost as exc:
                    raise _Moved("stream_error", exc.message) from None
                except GenerationError as exc:
                    if exc.kind in MOVABLE:
                        raise _Moved("stream_error", exc.message) from None
                    raise
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            lost.cancel()
            if member is not None:
                member.attempts.discard(attempt)
            self.done(target, journey)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
